"""Calls to the user's code that may be slow, run together, each with a time limit.

An environment's ``reset`` and ``step``, a tool, an LLM judge: each call can take from milliseconds
to seconds (a sandbox, an HTTP service), and one that never answers would stop training forever
without a word. :func:`run_bounded` runs a batch of such calls concurrently, at most
``max_concurrency`` at once, and gives each at most ``timeout`` seconds:

- a coroutine function (``async def``) is awaited on the process's background event loop
  (``lightning_ppo.runs.background_loop``, the loop async rewards run on too);
- a plain function runs on a daemon thread of its own; one that returns an awaitable has it
  awaited on the loop as well.

The outcomes come back in the order of the calls, whatever order they finished in, so what the
caller does with them is deterministic. What a time limit does not do:

- A plain call that times out cannot be stopped: its thread is left running (a daemon: it never
  keeps the process alive), late. Those threads are bounded (``lightning_ppo.runs.call_threads``):
  while ``leftovers`` (default ``max_concurrency``) late calls of the same function still run, a new
  call of it waits for one to end; once they have run four times their limit they are stuck, and
  the run stops with one line saying so (:class:`CallsStuck`), rather than wait for good or time
  out every later call in silence.
- An ``async def`` that ignores its cancellation is not waited for past its limit: it is reported
  timed out and left to end on the loop.
- An ``async def`` that blocks (``time.sleep``) holds the one loop, so no time limit can fire:
  such a call is named in one line once it has held the loop past its limit (``LoopBlocked``), and
  a new loop serves the calls after it.

Whatever a call raises is its outcome, also ``CancelledError`` and ``StopIteration``; ``SystemExit`` and
``KeyboardInterrupt`` (``sys.exit()`` in the user's code) never reach the loop's thread: they stop
the run with one line naming the call (:class:`CallExited`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lightning_ppo.runs.background_loop import LoopBlocked, background_loop, wait_on_loop
from lightning_ppo.runs.call_threads import LATE_CALLS, CallsStuck, Outcome
from lightning_ppo.runs.errors import UsageError

__all__ = [
    "CallExited",
    "CallsStuck",
    "Outcome",
    "await_bounded",
    "background_loop",
    "call_exited",
    "run_bounded",
]

# A blocked loop is judged so this long after the call's own time limit (scheduling noise on a
# loaded machine must not read as a block).
BLOCKED_GRACE_S = 1.0


class CallExited(UsageError):
    """The user's code raised ``SystemExit`` or ``KeyboardInterrupt`` inside a call."""


def run_bounded(
    calls: Sequence[Callable[[], Any]],
    timeout: float | None,
    max_concurrency: int,
    leftovers: int | None = None,
) -> list[Outcome]:
    """Run every call (no arguments; bind them with ``functools.partial``), at most
    ``max_concurrency`` at once, each within ``timeout`` seconds (``None``: no limit), and return
    their outcomes in order. ``leftovers``: how many late calls of one function (past their limit,
    still running on their threads) there may be before a new one waits (default
    ``max_concurrency``)."""
    if not calls:
        return []
    names = [call_name(call) for call in calls]
    limit = leftovers if leftovers is not None else max_concurrency

    async def run_all() -> list[Outcome]:
        slots = asyncio.Semaphore(max_concurrency)
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(_bounded(call, name, slots, timeout, limit), name=name)
            for call, name in zip(calls, names, strict=True)
        ]
        return list(await asyncio.gather(*tasks))

    return _raise_exits(_on_loop(run_all, timeout), names)


def await_bounded(
    awaitables: Sequence[Awaitable[Any]], timeout: float | None, names: Sequence[str] | None = None
) -> list[Outcome]:
    """Await every awaitable together on the background loop, each within ``timeout`` seconds; their
    outcomes in order (an async reward's batch, already called). ``names``: what one lines call them
    (default: each awaitable's qualified name)."""
    if not awaitables:
        return []
    if names is None:
        names = [getattr(awaitable, "__qualname__", type(awaitable).__name__) for awaitable in awaitables]

    async def run_all() -> list[Outcome]:
        waits = [_within(_returns(a), name, timeout) for a, name in zip(awaitables, names, strict=True)]
        return list(await asyncio.gather(*waits))

    return _raise_exits(_on_loop(run_all, timeout), names)


def call_name(call: Callable[..., Any]) -> str:
    """``Class.method`` of a bound method (the instance's class), a function's qualified name; also
    behind ``functools.partial``."""
    while hasattr(call, "func"):
        call = call.func  # type: ignore[attr-defined]
    owner = getattr(call, "__self__", None)
    name = getattr(call, "__name__", type(call).__name__)
    if owner is not None and not inspect.ismodule(owner):
        return f"{type(owner).__name__ if not isinstance(owner, type) else owner.__name__}.{name}"
    return getattr(call, "__qualname__", name)


def _on_loop(run_all: Callable[[], Awaitable[list[Outcome]]], timeout: float | None) -> list[Outcome]:
    loop = background_loop()
    future = asyncio.run_coroutine_threadsafe(run_all(), loop)
    blocked_after = None if timeout is None else timeout + BLOCKED_GRACE_S
    return wait_on_loop(future, loop, blocked_after)


def _raise_exits(outcomes: list[Outcome], names: list[str]) -> list[Outcome]:
    """The outcomes, unless one stops the run (in one line): the user's code exiting, a stuck
    function, a blocked loop; also from a call nested in this one (a tool inside an environment's
    step), so that ``on_error: drop`` does not drop what must stop."""
    for outcome, name in zip(outcomes, names, strict=True):
        if isinstance(outcome.error, (CallExited, CallsStuck, LoopBlocked)):
            raise outcome.error
        if isinstance(outcome.error, (SystemExit, KeyboardInterrupt)):
            raise call_exited(name, outcome.error) from outcome.error
    return outcomes


def call_exited(name: str, error: BaseException) -> CallExited:
    """The one line for the user's code exiting (``sys.exit()``, a ``KeyboardInterrupt`` raised where
    no Ctrl-C lands), which must not end the run as if it had finished."""
    return CallExited(
        f"{name} raised {type(error).__name__}({error}): code that training calls must raise an "
        "exception, not exit; the run stops here"
    )


async def _bounded(
    call: Callable[[], Any], name: str, slots: asyncio.Semaphore, timeout: float | None, leftovers: int
) -> Outcome:
    async with slots:
        if _is_async(call):
            return await _within(call, name, timeout)
        try:  # not part of the call's limit, as the wait for a slot is not
            await LATE_CALLS.place(name, leftovers)
        except CallsStuck as stuck:
            return Outcome(error=stuck)
        job = LATE_CALLS.start(call)
        try:
            outcome = await _within(lambda: job.future, name, timeout)
        except asyncio.CancelledError:  # the batch was cancelled (a Ctrl-C): its thread runs on
            if timeout is not None:
                job.leave(name, timeout)
            raise
        if outcome.timed_out and timeout is not None:
            job.leave(name, timeout)  # before the next call looks for a place
        if isinstance(outcome.value, Outcome):
            outcome = outcome.value  # the call's own, from its thread: what it returned or raised
        if outcome.error is not None or outcome.timed_out or not inspect.isawaitable(outcome.value):
            return outcome
        return await _within(_returns(outcome.value), name, timeout)  # a plain call returned an awaitable


async def _within(start: Callable[[], Awaitable[Any]], name: str, timeout: float | None) -> Outcome:
    """``await start()`` within ``timeout``, on a task named after the call (what a blocked loop
    names), whatever it raises caught inside that task. Past the limit the task is cancelled and not
    awaited: a call that ignores its cancellation is not waited for."""
    task = asyncio.get_running_loop().create_task(_guarded(start), name=name)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:  # the batch was cancelled (a Ctrl-C): so is the call
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    return Outcome(timed_out=True)


async def _guarded(start: Callable[[], Awaitable[Any]]) -> Outcome:
    # Caught here, inside the task that runs the user's code: a SystemExit or KeyboardInterrupt that
    # left a task would end the loop's thread, and every later call would wait forever. A
    # CancelledError is the call's outcome too (its own, or the time limit's: then nobody reads it).
    try:
        return Outcome(value=await start())
    except BaseException as err:  # noqa: BLE001  (the call's outcome; the caller says whose call it was)
        return Outcome(error=err)


def _returns(awaitable: Awaitable[Any]) -> Callable[[], Awaitable[Any]]:
    return lambda: awaitable


def _is_async(call: Callable[[], Any]) -> bool:
    """``async def`` functions and methods, also behind ``functools.partial``."""
    while hasattr(call, "func"):
        call = call.func  # type: ignore[attr-defined]
    return inspect.iscoroutinefunction(call)
