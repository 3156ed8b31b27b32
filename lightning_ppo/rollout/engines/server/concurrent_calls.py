"""A few calls to the generation servers at once, on threads, while the caller does other work.

The in-memory weight sync (:mod:`.memory_sync`) asks every server's workers to join its group or
receive a sync (one call per server, each returning once the broadcast it takes part in is over)
while rank 0 broadcasts. Each call waits on its own daemon thread (at most ``max_in_flight`` at
once); they fail as soon as one fails, or once none has answered for ``stall_timeout`` seconds
(:class:`Stalled`, which a batch of completions raises too: :mod:`.batch`). A call still
waiting then is abandoned (a daemon thread: it never holds the process's exit; its socket gives up
on its own within its timeout).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class Stalled(Exception):
    """No request of the batch answered for ``stall_timeout`` seconds; ``waiting`` are the indices of
    the requests still unanswered."""

    def __init__(self, waiting: list[int]) -> None:
        super().__init__(f"{len(waiting)} requests unanswered")
        self.waiting = waiting


class Requests:
    """``calls`` started at once on daemon threads (at most ``max_in_flight`` running), while the
    caller does something else (a weights broadcast the calls take part in); :meth:`wait` for them."""

    def __init__(self, calls: Sequence[Callable[[], Any]], max_in_flight: int) -> None:
        self.calls = calls
        self.results: list[Any] = [None] * len(calls)
        self.error: BaseException | None = None  # the first call's exception
        self.errors: list[BaseException] = []  # every call's that answered one, in order
        self.answers: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()
        self.waiting = set(range(min(max_in_flight, len(calls))))
        self.following = len(self.waiting)
        for index in sorted(self.waiting):
            self._start(index)

    def failure(self) -> BaseException | None:
        """The exception of a call that failed already, if any (without waiting for the others)."""
        while self.error is None and not self.answers.empty():
            self._take(*self.answers.get_nowait())
        return self.error

    def failure_within(self, seconds: float, counts: Callable[[BaseException], bool]) -> BaseException | None:
        """The first exception of a call for which ``counts`` holds, waiting up to ``seconds`` for one
        while calls are unanswered (a sync that failed: the answer that says why may be on its way)."""
        deadline = time.monotonic() + seconds
        while True:
            while not self.answers.empty():  # those in already, even with no time left to wait
                self._take(*self.answers.get_nowait())
            found = next((error for error in self.errors if counts(error)), None)
            left = deadline - time.monotonic()
            if found is not None or not self.waiting or left <= 0:
                return found
            try:
                self._take(*self.answers.get(timeout=left))
            except queue.Empty:
                return None

    def wait(self, stall_timeout: float) -> list[Any]:
        """Every result, in order; the first exception is raised, and :class:`Stalled` once no call
        has answered for ``stall_timeout`` seconds."""
        while self.error is None and self.waiting:
            try:
                self._take(*self.answers.get(timeout=stall_timeout))
            except queue.Empty:
                raise Stalled(sorted(self.waiting)) from None
        if self.error is not None:
            raise self.error
        return self.results

    def _take(self, index: int, value: Any, error: BaseException | None) -> None:
        if error is not None:
            self.error = self.error or error
            self.errors.append(error)
            self.waiting.discard(index)
            return
        self.results[index] = value
        self.waiting.discard(index)
        if self.following < len(self.calls):
            self.waiting.add(self.following)
            self._start(self.following)
            self.following += 1

    def _start(self, index: int) -> None:
        threading.Thread(target=self._work, args=(index,), name="lightning-ppo-request", daemon=True).start()

    def _work(self, index: int) -> None:
        try:
            self.answers.put((index, self.calls[index](), None))
        except BaseException as err:  # noqa: BLE001  (raised by the caller, in the main flow)
            self.answers.put((index, None, err))
