"""A batch's requests to the generation servers, sent together, with one bound for the batch.

Each request waits on its own daemon thread (at most ``max_in_flight`` at once) and the batch
fails as soon as one request fails, or once no request has answered for ``stall_timeout``
seconds: a hung server stops the batch within one ``generation.server_timeout``, not once per
wave of requests, and a request still waiting is abandoned (a daemon thread: it never holds the
process's exit; its socket gives up on its own within the same timeout).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class Stalled(Exception):
    """No request of the batch answered for ``stall_timeout`` seconds; ``waiting`` are the indices of
    the requests still unanswered."""

    def __init__(self, waiting: list[int]) -> None:
        super().__init__(f"{len(waiting)} requests unanswered")
        self.waiting = waiting


def send_all(calls: Sequence[Callable[[], T]], stall_timeout: float, max_in_flight: int) -> list[T]:
    """Every call's result, in order; the first exception raised by any call is raised here (the
    rest are abandoned), and :class:`Stalled` when none answers for ``stall_timeout`` seconds."""
    answers: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()

    def work(index: int) -> None:
        try:
            answers.put((index, calls[index](), None))
        except BaseException as err:  # noqa: BLE001  (raised by the caller, in the main flow)
            answers.put((index, None, err))

    def start(index: int) -> None:
        threading.Thread(target=work, args=(index,), name="lightning-ppo-request", daemon=True).start()

    results: list[Any] = [None] * len(calls)
    waiting = set(range(min(max_in_flight, len(calls))))
    for index in sorted(waiting):
        start(index)
    following = len(waiting)
    while waiting:
        try:
            index, value, error = answers.get(timeout=stall_timeout)
        except queue.Empty:
            raise Stalled(sorted(waiting)) from None
        if error is not None:
            raise error
        results[index] = value
        waiting.discard(index)
        if following < len(calls):
            waiting.add(following)
            start(following)
            following += 1
    return results
