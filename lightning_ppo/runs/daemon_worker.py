"""One background thread that runs jobs in order and never holds the process's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a job
stuck on a hung peer (a generation server that stopped answering) would keep a failed run's
process alive after its error was printed. This worker's thread is a daemon: the process ends when
the main thread does, and a job still running is abandoned with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonWorker:
    """Runs submitted calls one after another on one daemon thread, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, call: Callable[[], Any]) -> Future:
        """``call()`` once the jobs before it are done; its result or exception lands on the future."""
        if self._closed:
            raise RuntimeError(f"{self.name}: submit after close")
        future: Future = Future()
        self._jobs.put((future, call))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return future

    def close(self, wait: bool) -> None:
        """No more jobs; those not started are cancelled. ``wait``: until the running one ends (it is
        bounded by its own timeouts); otherwise it is left to end on its own."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as err:  # noqa: BLE001  (handed to whoever waits on the future)
                future.set_exception(err)
