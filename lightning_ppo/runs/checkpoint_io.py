"""Atomic local checkpoint files: written beside the target, synced, then renamed over it.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in
the system temp dir. When that is another filesystem than the checkpoint folder (``/tmp`` on tmpfs,
checkpoints on a disk), the commit is a copy over the target in place: a kill during the copy leaves
a truncated ``last.ckpt``, a full disk leaves one too, and a killed run leaves its whole checkpoint in
``/tmp``. Here the temporary file is a hidden sibling of the target (same filesystem), so the final
step is one ``os.replace``: the target is either the old complete file or the new complete file.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_ppo._moved import old_paths_allowed
from lightning_ppo.runs.processes import host_name, writer_gone

# ".last.ckpt.tmp-node7-1234": hidden, so neither Lightning's "last" lookup nor a user's glob sees it,
# and named after the writing process (host and pid: the folder may be on a disk that several
# machines share), so a new run can tell a dead run's leftovers from a live writer's.
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)$")


def temp_path(target: Path) -> Path:
    """The hidden file beside ``target`` that this process writes before renaming it to ``target``."""
    return target.with_name(f".{target.name}.tmp-{host_name()}-{os.getpid()}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves never leave a partial file under the checkpoint's name.

    The file is written to a hidden temporary name in the target's folder, flushed and fsynced, then
    renamed over the target, and the folder is fsynced so the rename survives a power cut. On any
    failure (a full disk, Ctrl-C) the temporary file is removed and the previous checkpoint is left as
    it was; an ``OSError`` is re-raised with the path and that fact in its message. Remote paths
    (``s3://``, ...) are Lightning's, unchanged; so is loading, but for a class allowed by its new
    path (``torch.serialization.add_safe_globals``) that a file names by its path before the
    package's modules moved: allowed too (:func:`lightning_ppo._moved.old_paths_allowed`).
    """

    def load_checkpoint(
        self, path: _PATH, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        with old_paths_allowed():
            return super().load_checkpoint(path, map_location, weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_path(target)
        try:
            with open(temp, "wb") as file:
                self.write(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, target)
        except BaseException as err:
            temp.unlink(missing_ok=True)
            cause = os_error_in(err)
            if cause is not None:
                raise save_error(cause, target) from err
            raise
        fsync_folder(target.parent)

    def write(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        """Serialize ``checkpoint`` into the open temporary file (a hook for tests to fail or stall)."""
        torch.save(checkpoint, file)


def os_error_in(err: BaseException) -> OSError | None:
    """The ``OSError`` behind ``err``: itself, or the one ``torch.save`` wrapped in a RuntimeError
    (its C++ writer turns a failing ``file.write`` into ``RuntimeError`` with the cause as context)."""
    seen: BaseException | None = err
    while isinstance(seen, RuntimeError):
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, OSError) else None


def save_error(err: OSError, target: Path) -> OSError:
    """``err`` (same type and errno) with a message saying which save failed and what is left."""
    reason = err.strerror or str(err)
    if target.exists():
        outcome = f"the previous {target.name} is intact"
    else:
        outcome = f"no {target.name} was written"
    return type(err)(err.errno or errno.EIO, f"could not write checkpoint {target}: {reason}; {outcome}")


def fsync_folder(folder: Path) -> None:
    """Persist a rename in ``folder`` (POSIX; Windows cannot open a folder for syncing)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def install_atomic_checkpoint_io(strategy: Strategy) -> None:
    """Make ``strategy`` save through :class:`AtomicCheckpointIO` if it uses Lightning's plain
    ``TorchCheckpointIO``.

    Any other plugin is the user's or the strategy's choice and is left alone: DeepSpeed and
    FSDP/ModelParallel sharded saves write folders through their own code, XLA and async plugins have
    their own writers.
    """
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


def remove_stale_temp_files(folder: _PATH) -> list[Path]:
    """Delete the temporary checkpoint files that killed runs left in ``folder``; returns them.

    Only files named like :func:`temp_path`'s are touched, and only those whose writer is known to
    be gone: a process of this host that no longer exists (one of another host sharing the folder
    may be saving right now; its pid means nothing here).
    """
    if not _is_local_file_protocol(folder) or not os.path.isdir(folder):
        return []
    removed = []
    for path in Path(folder).iterdir():
        match = _TEMP_NAME.match(path.name)
        if match is None or not path.is_file() or not writer_gone(match["host"], int(match["pid"])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        rank_zero_info(f"removed {len(removed)} temporary checkpoint file(s) left by killed runs in {folder}")
    return removed
