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
  keeps the process alive). Those threads are bounded: once ``leftovers`` (default
  ``max_concurrency``) timed-out calls of the same function still run, the function is stuck, and
  the next call of it stops the run with one line saying so (:class:`CallsStuck`), rather than
  start another thread or wait out a limit for every later call.
- An ``async def`` that ignores its cancellation is not waited for past its limit: it is reported
  timed out and left to end on the loop.
- An ``async def`` that blocks (``time.sleep``) holds the one loop, so no time limit can fire:
  such a call is named in one line once it has held the loop past its limit (``LoopBlocked``), and
  a new loop serves the calls after it.

Whatever a call raises is its outcome, also ``CancelledError``; ``SystemExit`` and
``KeyboardInterrupt`` (``sys.exit()`` in the user's code) never reach the loop's thread: they stop
the run with one line naming the call (:class:`CallExited`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ppo.runs.background_loop import LoopBlocked, background_loop, wait_on_loop
from lightning_ppo.runs.errors import UsageError

__all__ = ["CallExited", "CallsStuck", "Outcome", "await_bounded", "background_loop", "run_bounded"]

# A blocked loop is judged so this long after the call's own time limit (scheduling noise on a
# loaded machine must not read as a block).
BLOCKED_GRACE_S = 1.0


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its ``value``, the ``error`` it raised, or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class CallExited(UsageError):
    """The user's code raised ``SystemExit`` or ``KeyboardInterrupt`` inside a call."""


class CallsStuck(UsageError):
    """As many calls of one function as may be left running after their time limit still run."""


def run_bounded(
    calls: Sequence[Callable[[], Any]],
    timeout: float | None,
    max_concurrency: int,
    leftovers: int | None = None,
) -> list[Outcome]:
    """Run every call (no arguments; bind them with ``functools.partial``), at most
    ``max_concurrency`` at once, each within ``timeout`` seconds (``None``: no limit), and return
    their outcomes in order. ``leftovers``: how many timed-out calls of one function may still run on
    their threads before a new one waits (default ``max_concurrency``)."""
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


def await_bounded(awaitables: Sequence[Awaitable[Any]], timeout: float | None) -> list[Outcome]:
    """Await every awaitable together on the background loop, each within ``timeout`` seconds; their
    outcomes in order (an async reward's batch, already called)."""
    if not awaitables:
        return []
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
            kind = type(outcome.error).__name__
            raise CallExited(
                f"{name} raised {kind}({outcome.error}): code that training calls must raise an "
                "exception, not exit; the run stops here"
            ) from outcome.error
    return outcomes


async def _bounded(
    call: Callable[[], Any], name: str, slots: asyncio.Semaphore, timeout: float | None, leftovers: int
) -> Outcome:
    async with slots:
        if _is_async(call):
            return await _within(call, name, timeout)
        outcome = await _within(lambda: _LEFTOVERS.run(call, name, leftovers), name, timeout)
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


class _Leftovers:
    """Threads of plain calls that timed out and still run, counted per function: nothing can stop
    them, so a function with ``leftovers`` of them waits for one to end before it starts another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    def count(self, name: str) -> int:
        with self._lock:
            return self._running[name]

    async def run(self, call: Callable[[], Any], name: str, leftovers: int) -> Any:
        """``call()`` on a daemon thread of its own, unless ``leftovers`` of them still run past
        their limit: the function is stuck, and waiting out a limit per later call would only
        hide it (every episode failing as a timeout)."""
        if self.count(name) >= leftovers:
            raise CallsStuck(
                f"{self.count(name)} calls of {name} are still running after their time limit (hung, "
                "their threads cannot be stopped): it is stuck; the run stops here"
            )
        job = _Job(call, asyncio.get_running_loop(), self)
        try:
            return await job.future
        except asyncio.CancelledError:  # timed out: the thread runs on, counted until it ends
            job.leave(name)
            raise

    def add(self, name: str) -> None:
        with self._lock:
            self._running[name] += 1

    def remove(self, name: str) -> None:
        with self._lock:
            self._running[name] -= 1


_LEFTOVERS = _Leftovers()


class _Job:
    """One plain call on its thread; its result or exception lands on :attr:`future`."""

    def __init__(
        self, call: Callable[[], Any], loop: asyncio.AbstractEventLoop, leftovers: _Leftovers
    ) -> None:
        self.loop, self.leftovers = loop, leftovers
        self.future: asyncio.Future = loop.create_future()
        self._lock = threading.Lock()
        self._finished, self._left_as = False, ""
        threading.Thread(target=self._work, args=(call,), name="lightning-ppo-call", daemon=True).start()

    def leave(self, name: str) -> None:
        """Nobody waits for it any more; count it as left over while its thread still runs."""
        with self._lock:
            if not self._finished:
                self._left_as = name
                self.leftovers.add(name)

    def _work(self, call: Callable[[], Any]) -> None:
        value, error = None, None
        try:
            value = call()
        except BaseException as err:  # noqa: BLE001  (handed to the caller, as the call's outcome)
            error = err
        with self._lock:
            self._finished = True
            if self._left_as:
                self.leftovers.remove(self._left_as)
        try:
            self.loop.call_soon_threadsafe(self._settle, value, error)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits for this any more
            pass

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)
