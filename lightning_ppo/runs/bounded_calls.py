"""Calls to the user's code that may be slow, run together, each with a time limit.

An environment's ``reset`` and ``step``, a tool, an LLM judge: each call can take from milliseconds
to seconds (a sandbox, an HTTP service), and one that never answers would stop training forever
without a word. :func:`run_bounded` runs a batch of such calls concurrently and gives each at most
``timeout`` seconds:

- a coroutine function (``async def``) is awaited on the process's background event loop
  (:func:`background_loop`, the loop async rewards run on too), all of them together;
- a plain function runs on a daemon thread of its own, at most ``max_concurrency`` at once; one
  that returns an awaitable has it awaited on the loop as well.

The outcomes come back in the order of the calls, whatever order they finished in, so what the
caller does with them is deterministic. A plain call that times out cannot be stopped: its thread
is abandoned (a daemon: it never keeps the process alive) and no longer counts against
``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_PID: int | None = None
_LOOP_LOCK = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for the user's async code: one per process, in a daemon thread,
    started on first use (and again in a forked child, where the parent's thread does not exist).
    One loop for the whole run, so an async client kept between calls stays on its loop, and a run
    started from inside a running loop (a notebook) works too."""
    global _LOOP, _LOOP_PID
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP_PID != os.getpid() or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lightning-ppo-async", daemon=True).start()
            _LOOP, _LOOP_PID = loop, os.getpid()
        return _LOOP


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its ``value``, the ``error`` it raised, or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def run_bounded(
    calls: Sequence[Callable[[], Any]], timeout: float | None, max_concurrency: int
) -> list[Outcome]:
    """Run every call (no arguments; bind them with ``functools.partial``), each within ``timeout``
    seconds (``None``: no limit), and return their outcomes in order."""
    if not calls:
        return []

    async def run_all() -> list[Outcome]:
        slots = asyncio.Semaphore(max_concurrency)
        return list(await asyncio.gather(*(_bounded(call, slots, timeout) for call in calls)))

    return asyncio.run_coroutine_threadsafe(run_all(), background_loop()).result()


def await_bounded(awaitables: Sequence[Awaitable[Any]], timeout: float | None) -> list[Outcome]:
    """Await every awaitable together on the background loop, each within ``timeout`` seconds; their
    outcomes in order (an async reward's batch, already called)."""
    if not awaitables:
        return []

    async def run_all() -> list[Outcome]:
        return list(await asyncio.gather(*(_within(awaitable, timeout) for awaitable in awaitables)))

    return asyncio.run_coroutine_threadsafe(run_all(), background_loop()).result()


async def _within(awaitable: Awaitable[Any], timeout: float | None) -> Outcome:
    try:
        return Outcome(value=await asyncio.wait_for(awaitable, timeout))
    except asyncio.TimeoutError:
        return Outcome(timed_out=True)
    except Exception as err:  # the caller says whose call it was
        return Outcome(error=err)


async def _bounded(call: Callable[[], Any], slots: asyncio.Semaphore, timeout: float | None) -> Outcome:
    if _is_async(call):
        return await _within(call(), timeout)
    async with slots:
        outcome = await _within(_in_thread(call), timeout)
    if outcome.error is not None or outcome.timed_out or not inspect.isawaitable(outcome.value):
        return outcome
    return await _within(outcome.value, timeout)  # a plain function that returned an awaitable


def _is_async(call: Callable[[], Any]) -> bool:
    """``async def`` functions and methods, also behind ``functools.partial``."""
    while hasattr(call, "func"):
        call = call.func  # type: ignore[attr-defined]
    return inspect.iscoroutinefunction(call)


def _in_thread(call: Callable[[], Any]) -> asyncio.Future:
    """``call()`` on a daemon thread of its own; its result or exception lands on the returned future."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile: nobody waits for it any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value = call()
        except BaseException as err:  # noqa: BLE001  (handed to the caller, as the call's outcome)
            loop.call_soon_threadsafe(settle, None, err)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=work, name="lightning-ppo-call", daemon=True).start()
    return future
