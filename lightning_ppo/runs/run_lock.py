"""One run per checkpoint folder: a lock file taken when training starts, given back when it ends.

Checking for another run's ``last.ckpt`` is check-then-use: two runs started at the same moment in
one folder both found none, both trained, and left their checkpoints mixed (``last.ckpt`` and
``last-v1.ckpt``). The lock is a file created with ``O_EXCL`` (atomic, also on NFS v3+), holding
the host name and process id of its run. A lock whose run is gone (killed, on this host: its pid
no longer exists) is recognised as stale and taken over; a lock from another host is never judged
stale by its pid alone, since that pid means nothing here.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_ppo.runs.processes import host_name, writer_gone

LOCK_NAME = ".lightning_ppo.lock"


class RunLock:
    """The lock of a checkpoint folder (taken by rank 0)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; ``None`` when taken, else who holds it (``host pid``)."""
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not _gone(holder):
                    return holder or "a run that left no name"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as lock:
                lock.write(f"{host_name()} {os.getpid()}\n")
            self.held = True
            return None
        return self._holder() or "another run"

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> str | None:
        try:
            return self.path.read_text().strip() or None
        except OSError:
            return None


def _gone(holder: str | None) -> bool:
    """Whether the run named ``host pid`` has ended: only decidable on this host."""
    if holder is None:
        return False
    host, _, pid = holder.rpartition(" ")
    return pid.isdigit() and writer_gone(host, int(pid))
