"""Saved weights as readable as every other file a save writes.

safetensors 0.8 writes each file through a temporary file of Rust's ``tempfile`` crate, created 0600
whatever the umask, then renamed into place (safetensors issue #782): ``model.safetensors`` of a
``save_pretrained`` folder is readable by its owner only, while ``config.json`` and the tokenizer
beside it get the usual 0644 under umask 022. A model exported for another user, or for a container
running under another uid, then fails to load. Checkpoints (``torch.save`` through ``open``) and JSON
files are not affected.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Protocol


class SavesPretrained(Protocol):
    """A model, PEFT model or tokenizer: anything written to a folder by ``save_pretrained``."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Any: ...


def open_mode(folder: Path) -> int:
    """The permission bits ``open(path, "w")`` gives a new file in ``folder``: 0o666 less the umask
    (and what a default ACL of the folder takes away). Read from a probe file created there with
    mode 0o666 and removed: setting the umask to read it would change it for the whole process, and
    a file another thread created meanwhile would come out 0666."""
    probe = folder / f".lightning-ppo-mode-{uuid.uuid4().hex}"
    descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(descriptor).st_mode & 0o777
    finally:
        os.close(descriptor)
        probe.unlink()


def save_pretrained(saveable: SavesPretrained, out: Path) -> None:
    """``saveable.save_pretrained(out)``, then the ``*.safetensors`` files it wrote get :func:`open_mode`
    (set on each file, never through the umask).

    Only files written by this save (new, or renamed over an old one: a new inode) are changed; other
    weight files already in ``out`` keep the mode their owner gave them.
    """
    before = {path: path.stat().st_ino for path in out.glob("*.safetensors")}
    saveable.save_pretrained(out)
    mode = open_mode(out)
    for path in out.glob("*.safetensors"):
        if before.get(path) != path.stat().st_ino:
            path.chmod(mode)
