"""A batch's completion requests on the engine's event loop, with one bound for the batch.

At most ``max_in_flight`` requests are out at once (as many workers on the loop, each sending the
next request once its last one is answered; no thread per request), the results come back in
order, and the batch fails as soon as one request fails, or once no request has answered for
``stall_timeout`` seconds (:class:`Stalled`): a hung server stops the batch within one
``generation.server_timeout``, not once per wave of requests, and a busy one that keeps answering
is not stopped. A batch that fails, stalls or is left (its caller interrupted) is cancelled on the
loop before the error reaches the caller: its requests' connections are closed, nothing of it runs
on, and the servers stop decoding what nobody waits for.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lightning_ppo.rollout.engines.server.concurrent_calls import Stalled

# How long a cancelled batch may take to close its requests' connections on the loop (the
# engine's own, which runs nothing else: milliseconds); a bound, not a wait.
CANCEL_WAIT_S = 10.0

Answer = tuple[int, Any, BaseException | None]  # a request's index, its result or its error


CLOSED = "the server engine's connections were closed (its fit ended) while a batch was out"


class ConnectionsClosed(RuntimeError):
    """The engine's connections were closed (its fit ended) while this batch was out."""


class Batch:
    """``calls`` (each returns an awaitable) started on ``loop`` at once, at most ``max_in_flight``
    running, while the caller does something else; :meth:`wait` for their results."""

    def __init__(
        self,
        calls: Sequence[Callable[[], Awaitable[Any]]],
        max_in_flight: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.results: list[Any] = [None] * len(calls)
        self.answered: set[int] = set()
        self.workers = max(1, min(max_in_flight, len(calls)))
        self.answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()  # from the loop to the caller
        self.ended = threading.Event()  # set by the loop once every request of the batch is over
        self.future = asyncio.run_coroutine_threadsafe(self._run(calls), loop)

    def wait(self, stall_timeout: float) -> list[Any]:
        """Every result, in order; the first exception is raised, and :class:`Stalled` once no
        request has answered for ``stall_timeout`` seconds. The batch is over when this returns."""
        try:
            while len(self.answered) < len(self.results):
                try:
                    index, value, error = self.answers.get(timeout=stall_timeout)
                except queue.Empty:
                    raise Stalled(self._waiting()) from None
                if error is not None:
                    raise error
                self.results[index] = value
                self.answered.add(index)
            return self.results
        finally:
            self._cancel()

    def _waiting(self) -> list[int]:
        """The requests out now: each worker takes the next index as its last request is answered."""
        started = min(len(self.results), len(self.answered) + self.workers)
        return [index for index in range(started) if index not in self.answered]

    def _cancel(self) -> None:
        """Cancels whatever of the batch still runs, and waits (bounded) until it has stopped."""
        self.future.cancel()  # nothing, once the batch is over
        self.ended.wait(CANCEL_WAIT_S)

    async def _run(self, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
        following = iter(range(len(calls)))  # shared: each worker takes the next request
        workers = [asyncio.ensure_future(self._work(calls, following)) for _ in range(self.workers)]
        try:
            await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:  # the caller left, or the engine's connections were closed
            self.answers.put((-1, None, ConnectionsClosed(CLOSED)))
            raise
        finally:
            for worker in workers:
                worker.cancel()
            try:
                await asyncio.gather(*workers, return_exceptions=True)
            finally:
                self.ended.set()

    async def _work(self, calls: Sequence[Callable[[], Awaitable[Any]]], following: Any) -> None:
        for index in following:
            try:
                value = await calls[index]()
            except Exception as err:  # raised by the caller, in the main flow; ends the batch
                self.answers.put((index, None, err))
                raise
            self.answers.put((index, value, None))
