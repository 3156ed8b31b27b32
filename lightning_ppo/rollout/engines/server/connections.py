"""The server engine's own event loop, on a daemon thread, and one pooled session per server.

A batch's completions (:mod:`.batch`) run on this loop, not on the process's shared one
(:mod:`lightning_ppo.runs.background_loop`): that one runs the user's async environments, tools
and rewards, where one blocking call would stall every request, and the batch's bound with them.
The engine makes its connections at its first batch, and again after :meth:`Connections.close`
(at the end of each fit: :mod:`lightning_ppo.rollout.fit_callbacks`), in a forked child (a loop's
thread does not survive a fork: the parent's is left alone there) or with another in-flight cap.
They are closed at the process's exit too; their thread, a daemon, never holds that exit.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lightning_ppo.rollout.engines.server.batch import Batch
from lightning_ppo.rollout.engines.server.client import ServerClient
from lightning_ppo.rollout.engines.server.session import ServerSession
from lightning_ppo.runs import fork_safe_loop

CLOSE_S = 10.0  # the most closing waits for the loop to cancel what runs and close its sockets


class Connections:
    """One session per server of ``clients`` (at most ``limit`` connections each: the requests one
    rank may have in flight on one server) on a loop of their own."""

    def __init__(self, clients: Sequence[ServerClient], limit: int) -> None:
        self.limit = limit
        self.sessions = [ServerSession(client, limit) for client in clients]
        self.loop = fork_safe_loop.new_event_loop()  # a forked child cannot unhook its sockets
        self.thread = threading.Thread(target=self.loop.run_forever, name="lightning-ppo-http", daemon=True)
        self.thread.start()
        self.pid = os.getpid()
        # close(), the engine let go of, or the process's exit: whichever comes first, once.
        self._close = weakref.finalize(self, _shut, self.loop, self.thread, self.sessions, self.pid)

    def serves(self, limit: int) -> bool:
        """Usable here, for ``limit`` in flight per server (not closed, not a forked parent's)."""
        return self.limit == limit and self.pid == os.getpid() and self._close.alive

    def send(
        self,
        calls: Sequence[Callable[[], Awaitable[Any]]],
        stall_timeout: float,
        in_flight: int | None = None,
    ) -> list[Any]:
        """Every call's result, in order (:class:`~.batch.Batch`), at most ``in_flight`` at once: one
        server's limit by default; a batch routed over several servers runs more (:mod:`.routing`)."""
        for session in self.sessions:  # each reads its key once, at the batch's first request
            session.new_batch()
        return Batch(calls, in_flight or self.limit, self.loop).wait(stall_timeout)

    def close(self) -> None:
        """Cancels any batch still out, closes every connection, ends the loop's thread."""
        self._close()


def _shut(loop: asyncio.AbstractEventLoop, thread: threading.Thread, sessions: list, pid: int) -> None:
    if pid != os.getpid():  # a forked child: the loop and its sessions are the parent's
        # Their sessions are dropped here unclosed, on purpose: not an error to log in the child.
        loop.set_exception_handler(lambda loop, context: None)
        return
    if not thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(_close_all(sessions), loop).result(CLOSE_S)
    except Exception:  # noqa: BLE001  (closing what is left: the loop stops below all the same)
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(CLOSE_S)
    if not thread.is_alive():
        loop.close()


async def _close_all(sessions: list[ServerSession]) -> None:
    """Cancels every batch still out (a fit that failed left one: its caller hears it), then closes
    the sessions."""
    running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    for session in sessions:
        await session.close()
