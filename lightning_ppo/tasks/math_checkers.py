r"""Checking a batch of math answers in worker processes, the whole batch within a time bound.

math-verify bounds each parse and each comparison by ``signal.alarm``: whole seconds, 5 by default,
on a main thread only (elsewhere it raises, so callers pass ``None`` and nothing is bounded). One
call after another, 256 degenerate answers (``\boxed{9^{9^{9^{9}}}}``, each 5 s) held one training
step for 21 minutes. Here:

- Each answer is checked in one of ``workers`` processes: ``python -c`` running
  :mod:`lightning_ppo.tasks.math_reading` as a script (it imports neither torch nor the package;
  not ``multiprocessing``, whose spawn would run an unguarded training script again, and whose fork
  copies a trainer's threads and CUDA). A worker's main thread bounds each answer by its own alarm.
- In two rounds: every answer first within ``FIRST_ROUND_S`` (right or wrong, a GSM8K answer takes
  milliseconds), then those not done within ``answer_timeout`` each, so a few slow answers never
  keep the others from being checked.
- All of it within ``batch_timeout`` seconds: at that deadline the workers are killed (an alarm
  does not interrupt a computation in C) and start again with the next batch. Starting them is not
  counted (a second or two, the first time).
- A worker that ends mid-batch (killed, crashed) loses only the answer it held, which the second
  round asks a live worker again; a Ctrl-C stops every worker, so that no answer of the interrupted
  batch is read as one of the next.

An answer not checked in time is ``None``; :class:`~lightning_ppo.tasks.math_answer.MathAnswerReward`
scores it 0.0 and counts it. ``workers=0`` checks in the calling process instead, one answer after
another, with math-verify's own timeouts (main thread only): no bound on the batch.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_ppo.tasks.math_reading import is_correct

FIRST_ROUND_S = 0.25
START_TIMEOUT_S = 120.0  # workers that do not say they are ready by then: an error
_SCRIPT = Path(__file__).with_name("math_reading.py")
# `python -c` puts the working folder first on the import path: a user's json.py or sympy.py there
# would be imported in place of the library's. It leaves the path before anything is imported.
_RUN = "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; import runpy; " + (
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)


class _Worker:
    """One checker process, asked one line at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _RUN, str(_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="ascii",  # JSON's escapes keep every line ASCII
            bufsize=1,
        )

    def send(self, line: str) -> bool:
        """Hand the worker ``line``; False if it had ended before (its pipe broken or closed)."""
        try:
            self.process.stdin.write(line + "\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            return True
        except (OSError, ValueError):
            return False

    def receive(self) -> str | None:
        """The worker's answer to what it was sent; ``None`` if it ended (killed at a deadline, crashed)."""
        try:
            return self.process.stdout.readline() or None  # type: ignore[union-attr]
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass


class Checkers:
    """``size`` worker processes, started on first use, kept between batches."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one batch at a time
        self._pid = os.getpid()
        atexit.register(self.close)

    def check(
        self, pairs: Sequence[tuple[str, str]], answer_timeout: float, batch_timeout: float
    ) -> list[bool | None]:
        """Whether each ``(truth, completion)`` is right; ``None`` where it was not checked in time."""
        if self.size == 0:
            return [_here(truth, completion, answer_timeout) for truth, completion in pairs]
        results: list[bool | None] = [None] * len(pairs)
        with self._lock:
            self._start()
            deadline = time.monotonic() + batch_timeout
            pending = list(range(len(pairs)))
            try:
                for seconds in sorted({min(FIRST_ROUND_S, answer_timeout), answer_timeout}):
                    self._workers = [worker for worker in self._workers if worker.alive()]
                    if pending and self._workers and time.monotonic() < deadline:
                        self._round(pairs, pending, seconds, results, deadline)
                        pending = [i for i in pending if results[i] is None]
            except BaseException:
                # A Ctrl-C (a notebook goes on to fit again): the feeding threads would go on asking
                # these workers, and the next batch would read their answers as its own.
                self._stop_all()
                raise
        return results

    def _round(
        self,
        pairs: Sequence[tuple[str, str]],
        pending: list[int],
        seconds: float,
        results: list[bool | None],
        deadline: float,
    ) -> None:
        """``pending`` answers, each within ``seconds``, shared out among the workers until ``deadline``."""
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in pending:
            todo.put(index)

        def feed(worker: _Worker) -> None:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                truth, completion = pairs[index]
                asked = {"truth": truth, "completion": completion, "seconds": seconds}
                if not worker.send(json.dumps(asked)):
                    todo.put(index)  # never asked: a live worker takes it
                    return
                reply = worker.receive()
                if reply is None:  # it ended on this answer, perhaps because of it: not in this round again
                    return
                results[index] = json.loads(reply)["correct"]

        threads = [
            threading.Thread(target=feed, args=(worker,), name="lightning-ppo-math-check", daemon=True)
            for worker in self._workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            self._stop_all()  # their pipes close: each feeding thread returns
            for thread in threads:
                thread.join(5.0)

    def _start(self) -> None:
        """As many live workers as ``size``; a new one counts once it says it is ready."""
        self._workers = [worker for worker in self._workers if worker.alive()]
        new = [_Worker() for _ in range(self.size - len(self._workers))]
        ready = [False] * len(new)

        def wait(index: int) -> None:
            line = new[index].process.stdout.readline()  # type: ignore[union-attr]
            ready[index] = bool(line) and json.loads(line).get("ready") is True

        waits = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(new))]
        for thread in waits:
            thread.start()
        started = time.monotonic()
        try:
            for thread in waits:
                thread.join(max(0.0, START_TIMEOUT_S - (time.monotonic() - started)))
        except BaseException:  # a Ctrl-C: none of them is in the pool yet, so nothing else stops them
            for worker in new:
                worker.stop()
            raise
        if not all(ready):
            for worker in new:
                worker.stop()
            raise RuntimeError(
                f"the math answer checkers ({sys.executable} running {_SCRIPT}) did not start within "
                f"{START_TIMEOUT_S:.0f} s; their error, if any, is above"
            )
        self._workers += new

    def _stop_all(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def close(self) -> None:
        """Stop the workers (at exit too); a forked child leaves its parent's alone."""
        if os.getpid() == self._pid:
            self._stop_all()


def _here(truth: str, completion: str, answer_timeout: float) -> bool:
    """``workers=0``: in this process, with math-verify's own alarm where one can be set."""
    on_main = threading.current_thread() is threading.main_thread()
    return is_correct(completion, truth, math.ceil(answer_timeout) if on_main else None)


_POOLS: dict[tuple[int, int], Checkers] = {}
_POOLS_LOCK = threading.Lock()


def checkers(workers: int) -> Checkers:
    """This process's pool of ``workers`` (a forked child, such as a ``ddp_fork`` rank, gets its own)."""
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = Checkers(workers)
        return _POOLS[key]
