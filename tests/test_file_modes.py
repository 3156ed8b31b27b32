"""Saved weights get the mode every other new file gets (``runs/file_modes``), and finding that mode
changes nothing of the process: other threads' files keep the umask's mode meanwhile."""

from __future__ import annotations

import os
import sys
import threading

from lightning_ppo.runs.file_modes import open_mode


def test_reading_the_mode_leaves_other_threads_files_alone(tmp_path):
    """``open_mode`` read the umask by setting it to 0 and back: a file another thread created in
    between came out 0666 (61 of 200k calls). Here one thread asks for the mode in a loop while
    another creates files (the interpreter switching threads as often as it can): each file gets the
    umask's 0644, and the mode asked for is that one every time."""
    old_mask, old_interval = os.umask(0o022), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    asked: list[int] = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set() and len(asked) < 20_000:
            asked.append(open_mode(tmp_path))

    asker = threading.Thread(target=ask, daemon=True)
    try:
        asker.start()
        modes = []
        for i in range(3000):
            path = tmp_path / f"f{i}"
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
            modes.append(path.stat().st_mode & 0o777)
            path.unlink()
        done.set()
        asker.join(120)
    finally:
        sys.setswitchinterval(old_interval)
        os.umask(old_mask)
    assert {oct(mode) for mode in modes} == {"0o644"}
    assert asked and set(asked) == {0o644}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left behind
