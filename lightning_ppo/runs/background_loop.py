"""The process's event loop for the user's async code, and a wait on it that cannot hang.

Async environments, tools and rewards run on one loop in a daemon thread (:func:`background_loop`),
so an async client kept between calls stays on its loop. Two things can stop that loop, and a
caller waiting on it would then wait forever:

- its thread ends (an exception escaped a callback, or the process forked): the next
  :func:`background_loop` builds a new one, and :func:`wait_on_loop` says so in one line rather
  than waiting;
- a callback holds it: an ``async def`` that makes a blocking call (``time.sleep``, ``requests``)
  stops every other coroutine, and no timeout can fire while it blocks. :func:`wait_on_loop` sends
  the loop a no-op while it waits; one left unanswered past ``blocked_after`` seconds means the loop
  is blocked: the loop is given up (a new one serves later calls; its own thread closes the old one
  once the call that held it returns) and :class:`LoopBlocked` names the task that held it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from lightning_ppo.runs import fork_safe_loop
from lightning_ppo.runs.errors import UsageError

POLL_S = 0.05  # how often a waiting caller looks at the loop
_DRAIN_S = 1.0  # how long a given-up loop, once free, runs on to finish what was cancelled on it


class LoopBlocked(UsageError):
    """An ``async def`` held the background loop longer than its time limit allows."""


@dataclass
class _Loop:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    pid: int

    def serves(self) -> bool:
        return self.pid == os.getpid() and self.thread.is_alive() and not self.loop.is_closed()


_CURRENT: _Loop | None = None
_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    """A child forked while another thread held ``_LOCK`` (starting the loop) inherits it held, by a
    thread that does not exist there: its first async call would wait forever."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def background_loop() -> asyncio.AbstractEventLoop:
    """The loop, started on first use and again when its thread is gone (a forked child, a given-up
    or stopped loop). One loop for the whole run, so a run started from inside a running loop (a
    notebook) works too."""
    global _CURRENT
    with _LOCK:
        if _CURRENT is None or not _CURRENT.serves():
            loop = fork_safe_loop.new_event_loop()  # a forked child cannot unhook its sockets
            thread = threading.Thread(target=_serve, args=(loop,), name="lightning-ppo-async", daemon=True)
            thread.start()
            _CURRENT = _Loop(loop, thread, os.getpid())
        return _CURRENT.loop


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread: it runs the loop until stopped (given up and free again, stopped, or ended
    by an exception), then closes it, which gives back its epoll object and self-pipe. Only this
    thread can: ``close()`` refuses a running loop, and a loop held by a coroutine that never returns
    is running for good; closing its descriptors under it from outside would hand their numbers to
    whatever opens next while the loop still polls them. Such a loop and its thread stay until exit."""
    try:
        loop.run_forever()
    finally:
        _forget(loop)  # no later call is handed a loop on its way out
        try:  # as asyncio.run: async generators left open get their aclose on a loop still open
            closing = loop.create_task(loop.shutdown_asyncgens())
            loop.run_until_complete(asyncio.wait({closing}, timeout=_DRAIN_S))
        finally:
            loop.close()


def _forget(loop: asyncio.AbstractEventLoop) -> None:
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None and _CURRENT.loop is loop:
            _CURRENT = None


def give_up(loop: asyncio.AbstractEventLoop) -> None:
    """Serve later calls from a new loop; ``loop`` stops, and its thread closes it, once whatever
    holds it lets go."""
    _forget(loop)
    # Once free, it finishes the cancelled calls (no pending tasks left), then stops.
    _call_soon(loop, loop.call_later, _DRAIN_S, loop.stop)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # closed meanwhile by its own thread: there is nothing left to tell it
        pass


def wait_on_loop(
    future: concurrent.futures.Future, loop: asyncio.AbstractEventLoop, blocked_after: float | None
) -> Any:
    """``future.result()`` of a coroutine run on ``loop``, watching the loop while it waits: a loop
    whose thread ended is a ``RuntimeError``, one blocked past ``blocked_after`` seconds (``None``:
    never judged blocked) is :class:`LoopBlocked`."""
    thread = _thread_of(loop)
    beat: threading.Event | None = None  # a no-op sent to the loop and not yet answered
    sent = 0.0
    while True:
        try:
            return future.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            pass
        except BaseException:  # a Ctrl-C while waiting: the calls are cancelled, not left to run on
            _cancel(future, loop)
            raise
        stopped = loop.is_closed() or (thread is not None and not thread.is_alive())
        if stopped and future.done():  # its answer came in just before the loop stopped
            return future.result()
        if stopped:
            _cancel(future, loop)
            raise RuntimeError("lightning_ppo's background event loop stopped; the call cannot finish")
        if beat is None or beat.is_set():
            beat, sent = threading.Event(), time.monotonic()
            _call_soon(loop, beat.set)  # a loop closed meanwhile is seen at the next look
        elif blocked_after is not None and time.monotonic() - sent > blocked_after:
            _cancel(future, loop)
            holder = _holder(loop)
            give_up(loop)
            raise LoopBlocked(
                f"async def {holder} blocked the event loop for over {blocked_after:.1f} s, so no time "
                "limit could fire: a blocking call (time.sleep, requests, subprocess.run) inside "
                "async def stops every async call; await the async form (asyncio.sleep, an async "
                "client) or make it a plain def, which runs on a thread of its own"
            )


def _cancel(future: concurrent.futures.Future, loop: asyncio.AbstractEventLoop) -> None:
    # The cancel is handed to the loop's thread; a closed loop's tasks are gone with it, and handing
    # it there would only log a RuntimeError from the future's callback.
    if not loop.is_closed():
        future.cancel()


def _thread_of(loop: asyncio.AbstractEventLoop) -> threading.Thread | None:
    current = _CURRENT
    return current.thread if current is not None and current.loop is loop else None


def _holder(loop: asyncio.AbstractEventLoop) -> str:
    """The name of the task running on ``loop`` now (the call that blocks it)."""
    task = asyncio.current_task(loop)
    return task.get_name() if task is not None else "code"
