"""Plain calls to the user's code, each on a daemon thread of its own; late ones counted, stuck ones named.

A plain ``def`` call (an environment's ``step``, a tool) cannot be stopped from outside: past its time
limit the caller stops waiting (a timeout) and the thread runs on. What that costs is bounded:

- A call is **late** while its thread runs past its limit. It holds one of its function's
  ``leftovers`` places until it ends; while every place is held, a new call of the function waits for
  one before its thread starts. The wait is not part of the new call's limit, as the wait for a
  ``max_concurrency`` slot is not: the limit measures the user's code, so one late step costs one
  timeout whatever ``max_concurrency`` is, and ``max_concurrency: 1`` stays one call at a time.
- A late call is **stuck** once it has run :data:`STUCK_AFTER_LIMITS` times its limit (plus
  :data:`STUCK_GRACE_S` of scheduling noise). When the places a new call waits for are all held by
  stuck calls, it stops the run with one line (:class:`CallsStuck`), rather than wait for good or
  time out every later call in silence.

So a function has at most ``leftovers`` late threads, and no call waits for a place longer than the
calls holding the places take to become stuck.

What the call raised travels inside its :class:`Outcome`, never through ``Future.set_exception``: an
asyncio future refuses ``StopIteration`` (``next()`` over no match, a common bug) with a
``TypeError`` the loop only logs, so the call would never settle; a ``CancelledError`` raised by the
call would read as its time limit cancelling it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_ppo.runs.background_loop import POLL_S
from lightning_ppo.runs.errors import UsageError

# A timed-out call still running this many times its limit after it started is stuck, not late: a
# call answering a few limits late (a retry, a slow sandbox) is not evidence that it never will.
STUCK_AFTER_LIMITS = 4
STUCK_GRACE_S = 1.0  # scheduling noise on a loaded machine must not read as stuck


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its ``value``, the ``error`` it raised, or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class CallsStuck(UsageError):
    """Every place a function's new call waits for is held by a call stuck past its time limit."""


class _Job:
    """One plain call on its thread; its :class:`Outcome` lands on :attr:`future`."""

    def __init__(self, call: Callable[[], Any], loop: asyncio.AbstractEventLoop, late: LateCalls) -> None:
        self.loop, self.late = loop, late
        self.future: asyncio.Future[Outcome] = loop.create_future()
        self.started = time.monotonic()
        self.stuck_at = float("inf")  # when it counts as stuck, once it is late
        self._lock = threading.Lock()
        self._finished, self._late_as = False, ""
        threading.Thread(target=self._work, args=(call,), name="lightning-ppo-call", daemon=True).start()

    def leave(self, name: str, timeout: float) -> None:
        """Past its ``timeout`` nobody waits for it any more: late while its thread still runs."""
        with self._lock:
            if not self._finished:
                self._late_as = name
                self.stuck_at = self.started + STUCK_AFTER_LIMITS * timeout + STUCK_GRACE_S
                self.late.add(name, self)

    def _work(self, call: Callable[[], Any]) -> None:
        try:
            outcome = Outcome(value=call())
        except BaseException as err:  # noqa: BLE001  (handed to the caller, as the call's outcome)
            outcome = Outcome(error=err)
        with self._lock:
            self._finished = True
            if self._late_as:
                self.late.remove(self._late_as, self)
        try:
            self.loop.call_soon_threadsafe(self._settle, outcome)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits for this any more
            pass

    def _settle(self, outcome: Outcome) -> None:
        if not self.future.done():  # else timed out and cancelled meanwhile
            self.future.set_result(outcome)


class LateCalls:
    """The threads of plain calls that ran past their limit and still run, per function (its name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._late: dict[str, set[_Job]] = {}

    def count(self, name: str) -> int:
        with self._lock:
            return len(self._late.get(name, ()))

    def add(self, name: str, job: _Job) -> None:
        with self._lock:
            self._late.setdefault(name, set()).add(job)

    def remove(self, name: str, job: _Job) -> None:
        with self._lock:
            self._late.get(name, set()).discard(job)

    async def place(self, name: str, leftovers: int) -> None:
        """Once fewer than ``leftovers`` late calls of ``name`` run; :class:`CallsStuck` when as many
        as that are stuck (so the wait ends by the time the calls it waits for are stuck)."""
        while True:
            with self._lock:
                stuck_at = sorted(job.stuck_at for job in self._late.get(name, ()))
            if len(stuck_at) < leftovers:
                return
            if time.monotonic() >= stuck_at[leftovers - 1]:
                raise CallsStuck(
                    f"{len(stuck_at)} calls of {name} are still running after their time limit, "
                    f"{leftovers} of them over {STUCK_AFTER_LIMITS} times it (hung, their threads "
                    "cannot be stopped): it is stuck; the run stops here"
                )
            await asyncio.sleep(POLL_S)

    def start(self, call: Callable[[], Any]) -> _Job:
        """``call()`` on a daemon thread of its own, its outcome on the job's future (awaited on the
        running loop); :meth:`_Job.leave` it once nobody waits for it."""
        return _Job(call, asyncio.get_running_loop(), self)

    def forget_all(self) -> None:
        """In a forked child: none of the parent's threads runs there (its lock may be held by one)."""
        self._lock = threading.Lock()
        self._late = {}


LATE_CALLS = LateCalls()
os.register_at_fork(after_in_child=LATE_CALLS.forget_all)
