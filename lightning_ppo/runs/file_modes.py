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
from pathlib import Path
from typing import Any, Protocol


class SavesPretrained(Protocol):
    """A model, PEFT model or tokenizer: anything written to a folder by ``save_pretrained``."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Any: ...


def open_mode() -> int:
    """The permission bits ``open(path, "w")`` gives a new file in this process: 0o666 less the umask."""
    umask = os.umask(0)  # the umask is read by setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def save_pretrained(saveable: SavesPretrained, out: Path) -> None:
    """``saveable.save_pretrained(out)``, then the ``*.safetensors`` files it wrote get :func:`open_mode`.

    Only files written by this save (new, or renamed over an old one: a new inode) are changed; other
    weight files already in ``out`` keep the mode their owner gave them.
    """
    before = {path: path.stat().st_ino for path in out.glob("*.safetensors")}
    saveable.save_pretrained(out)
    mode = open_mode()
    for path in out.glob("*.safetensors"):
        if before.get(path) != path.stat().st_ino:
            path.chmod(mode)
