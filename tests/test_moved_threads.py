"""``_moved.old_paths_allowed`` under threads: torch's allow-list is the process's, not a thread's."""

from __future__ import annotations

import threading

import torch

from lightning_ppo import _moved
from lightning_ppo.models.roles import LoraSettings
from tests.test_moved import _pickled_under_the_old_path

OLD_NAME = (LoraSettings, "lightning_ppo.roles.LoraSettings")


def test_a_reader_keeps_the_old_names_while_another_threads_reader_leaves():
    """Two readers of the package at once (a checkpoint exported on a thread while the run resumes):
    the first in added the old names, the second found them there and added none; the first, leaving,
    removed them while the second was still reading, which refused its old file. Each name now stays
    while any reader is inside, and goes with the last one."""
    entered, leave, left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with _moved.old_paths_allowed():
            entered.set()
            leave.wait(60)  # a bound: the main thread sets it at once
        left.set()

    with torch.serialization.safe_globals([LoraSettings]):  # allowed by its new path, as a user does
        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        try:
            assert entered.wait(60)
            with _moved.old_paths_allowed():
                leave.set()
                assert left.wait(60)  # the first reader has left, this one is still reading
                loaded = torch.load(_pickled_under_the_old_path(LoraSettings(r=3)), weights_only=True)
                assert loaded["lora"] == LoraSettings(r=3)
        finally:
            leave.set()
            thread.join(60)
        assert OLD_NAME not in torch.serialization.get_safe_globals()  # gone with the last reader


def test_an_old_name_the_user_allowed_stays_allowed_after_the_readers_leave():
    with torch.serialization.safe_globals([LoraSettings, OLD_NAME]):
        with _moved.old_paths_allowed(), _moved.old_paths_allowed():
            pass
        assert OLD_NAME in torch.serialization.get_safe_globals()
    assert OLD_NAME not in torch.serialization.get_safe_globals()
