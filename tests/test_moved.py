"""Old module paths (lightning_ppo._moved): importing one leaves the new module as it was."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_ppo import _moved
from lightning_ppo.models.roles import LoraSettings

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
