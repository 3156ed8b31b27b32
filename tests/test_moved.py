"""Old module paths (lightning_ppo._moved): importing one leaves the new module as it was."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME

import lightning_ppo.checkpoint
from lightning_ppo import _moved
from lightning_ppo.export import read_checkpoint
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.runs.checkpoint_io import AtomicCheckpointIO
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.log_continuity import LOGS_KEY, read_logger_records
from lightning_ppo.runs.preflight import check_checkpoint_file

# In a fresh interpreter: the old path imported for the first time, then the new module asked for
# its spec and reloaded (here, reloading would redefine classes the other tests hold).
AFTER_AN_OLD_IMPORT = """
import importlib, importlib.util, warnings
import lightning_ppo.runs.typos as new
own = new.__spec__
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import lightning_ppo.typos as old
assert old is new
assert new.__spec__ is own, new.__spec__
assert importlib.util.find_spec("lightning_ppo.runs.typos") is own
new._CLASS_PATH = None
assert importlib.reload(new) is new
assert new.__name__ == "lightning_ppo.runs.typos", new.__name__
assert new._CLASS_PATH is not None  # the module's code ran again
"""


def test_importing_an_old_path_leaves_the_new_modules_spec_its_own():
    done = subprocess.run([sys.executable, "-c", AFTER_AN_OLD_IMPORT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _pickled_under_the_old_path(obj: object) -> io.BytesIO:
    """``obj`` saved as before the move: its class named ``lightning_ppo.roles.LoraSettings``."""
    cls = type(obj)
    buffer = io.BytesIO()
    cls.__module__ = "lightning_ppo.roles"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.save({"lora": obj}, buffer)
    finally:
        cls.__module__ = "lightning_ppo.models.roles"
    buffer.seek(0)
    return buffer


def test_an_old_path_pickle_loads_with_the_class_allowed_under_its_new_path():
    with (
        torch.serialization.safe_globals([LoraSettings]),
        pytest.raises(Exception, match="lightning_ppo.roles"),
    ):
        torch.load(_pickled_under_the_old_path(LoraSettings(r=3)), weights_only=True)
    with torch.serialization.safe_globals(_moved.with_old_paths([LoraSettings])):
        loaded = torch.load(_pickled_under_the_old_path(LoraSettings(r=3)), weights_only=True)
    assert loaded["lora"] == LoraSettings(r=3) and type(loaded["lora"]) is LoraSettings
    assert _moved.with_old_paths([torch.Size]) == [torch.Size]  # nothing added for what never moved
    assert lightning_ppo.checkpoint.with_old_paths is _moved.with_old_paths  # its public place


@contextmanager
def _named_as(old: dict[type, str]) -> Iterator[None]:
    """Each class pickled under its module before the move (``old``: class -> that module)."""
    new = {cls: cls.__module__ for cls in old}
    for cls, module in old.items():
        cls.__module__ = module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for cls, module in new.items():
            cls.__module__ = module


def _old_checkpoint(path: Path) -> Path:
    """A checkpoint as a run before the move wrote it, with objects of moved classes in it (a user's
    callback state, say): ``LoraSettings`` then in ``lightning_ppo.roles`` (a module renamed) and
    ``PromptBatch`` then in ``lightning_ppo.data`` (a class moved to another module)."""
    batch = PromptBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), ["ab"])
    checkpoint = {
        "state_dict": {"roles.policy.w": torch.zeros(2)},
        "hyper_parameters": {"policy": "gpt2"},
        LOGS_KEY: [{"kind": "csv", "version": 3}],
        "callbacks": {"Kept": {"lora": LoraSettings(r=3), "batch": batch}},
    }
    with _named_as({LoraSettings: "lightning_ppo.roles", PromptBatch: "lightning_ppo.data"}):
        torch.save(checkpoint, path)
    return path


def _old_sharded_checkpoint(folder: Path) -> Path:
    """The same as a sharded (FSDP2) checkpoint folder: the weights as shards, the rest in meta.pt."""
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": {"roles.policy.w": torch.zeros(2)}}, checkpoint_id=folder)
    _old_checkpoint(folder / _METADATA_FILENAME)
    return folder


def test_an_old_checkpoint_loads_through_the_packages_readers_with_its_classes_allowed_by_new_paths(tmp_path):
    """Before, each of the package's readers matched the pickle's old names against the new ones the
    user allowed, and refused it (preflight's error, the log records lost, export and resume failed)."""
    path = _old_checkpoint(tmp_path / "old.ckpt")
    with pytest.raises(UsageError, match="refuses"):  # nothing allowed: still refused
        check_checkpoint_file(str(path))
    with torch.serialization.safe_globals([LoraSettings, PromptBatch]):
        check_checkpoint_file(str(path))
        assert read_logger_records(path) == [{"kind": "csv", "version": 3}]
        folder = _old_sharded_checkpoint(tmp_path / "old-sharded.ckpt")
        readers = (read_checkpoint(path), read_checkpoint(folder), AtomicCheckpointIO().load_checkpoint(path))
        for loaded in readers:
            kept = loaded["callbacks"]["Kept"]
            assert kept["lora"] == LoraSettings(r=3) and type(kept["batch"]) is PromptBatch
            assert kept["batch"].prompts == ["ab"]
    assert LoraSettings not in torch.serialization.get_safe_globals()  # and nothing stays allowed
    assert not [g for g in torch.serialization.get_safe_globals() if isinstance(g, tuple)]


def test_old_names_cover_classes_that_left_their_module():
    """``with_old_paths`` also names a class by the module it left (one that stayed or became a
    folder, where MOVED has no entry): each new name in the table is that class today."""
    assert (PromptBatch, "lightning_ppo.data.PromptBatch") in _moved.with_old_paths([PromptBatch])
    for old, new in _moved.MOVED_CLASSES.items():
        module, _, name = f"lightning_ppo.{new}".rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert f"{cls.__module__}.{cls.__qualname__}" == f"lightning_ppo.{new}"
        assert (cls, f"lightning_ppo.{old}") in _moved.with_old_paths([cls])
