"""Sharded (FSDP2) checkpoint folders: written beside the target and renamed into place, trained
weights only.

Lightning's ``ModelParallelStrategy`` writes a checkpoint folder in place: every rank writes its
shard file into ``last.ckpt/``, then rank 0 writes ``meta.pt``. A kill or a full disk in between
leaves a folder of new shards beside an old ``meta.pt``, which the next ``--ckpt_path last`` reads.
Here every rank writes into one hidden folder beside the target (``.last.ckpt.tmpdir-<host>-<pid>``,
named by rank 0), the ranks agree that all of them succeeded, and rank 0 renames that folder over
the target, so the target is always a complete checkpoint, old or new.

The folders also hold only what training changed, as the single-file checkpoints do: the frozen
roles (reference, reward models, a LoRA base) are reloaded from their own paths when the module is
built, and a resume asks the folder for the trained weights only (Lightning's distributed load asks
for every key of the module, so it could not leave them out).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lightning_ppo._moved import old_paths_allowed
from lightning_ppo.runs.checkpoint_io import fsync_folder, os_error_in, save_error
from lightning_ppo.runs.run_lock import _gone

# ".last.ckpt.tmpdir-node1-1234" (being written) and ".last.ckpt.old-node1-1234" (the previous
# checkpoint, moved aside for the moment of the swap): hidden, and not ".ckpt", so Lightning's "last"
# lookup never takes them; named after rank 0's host and pid, so a later run can tell a dead run's.
_FOLDER_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<kind>tmpdir|old)-(?P<host>.+)-(?P<pid>\d+)$")


def side_folder(target: Path, kind: str) -> Path:
    """The hidden folder of ``kind`` (``tmpdir`` or ``old``) beside ``target`` for this process."""
    return target.with_name(f".{target.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded saves are atomic and hold the trained weights only.

    Saves with ``save_distributed_checkpoint=False`` (one full file) and remote paths are Lightning's,
    unchanged; loading a full file too. Loading a folder loads the trained weights it holds (also from
    folders written before this class, which hold every weight).
    """

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return trained_state_dict(self.model, full_state_dict=not self._save_distributed_checkpoint)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None or not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        filepath = self.broadcast(filepath)  # rank 0's: every rank writes into the same folder
        if not _is_local_file_protocol(filepath):
            super().save_checkpoint(checkpoint, filepath)
            return
        target = Path(filepath)
        temp = self.broadcast(side_folder(target, "tmpdir"))  # rank 0 names it: one folder for all ranks
        try:
            self.write_folder(checkpoint, temp)
            error = None
        except BaseException as err:  # a full disk, Ctrl-C: decided with the other ranks below
            error = err
        failure = first_failure(error, self.world_size, temp)  # also the barrier: every rank has written
        if failure is None and self.is_global_zero:
            try:
                publish(temp, target)
            except Exception as err:
                error, failure = err, (0, *describe(err))
        failure = self.broadcast(failure)  # no rank goes on (to read or remove it) before it is in place
        if failure is not None:
            if self.is_global_zero:
                shutil.rmtree(temp, ignore_errors=True)
            raise_save_failure(failure, error, target)

    def write_folder(self, checkpoint: dict[str, Any], folder: Path) -> None:
        """Lightning's sharded layout in ``folder``: one shard file per rank, rank 0's ``meta.pt`` last."""
        folder.mkdir(parents=True, exist_ok=True)
        optimizers = checkpoint.get("optimizer_states", [])
        shards = {"state_dict": checkpoint["state_dict"]}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(optimizers)})
        dcp.save(shards, storage_writer=self.shard_writer(folder))  # fsyncs each shard file
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            with open(folder / _METADATA_FILENAME, "wb") as file:
                torch.save(rest, file)
                file.flush()
                os.fsync(file.fileno())

    def shard_writer(self, folder: Path) -> FileSystemWriter:
        """The writer of this rank's shards (a hook for tests to fail or stall a save)."""
        return FileSystemWriter(folder)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # old class paths allowed, as runs.checkpoint_io's load allows them (lightning_ppo._moved)
        with old_paths_allowed():
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only)
        module = self.model
        trained = {"state_dict": trained_state_dict(module, cpu_offload=False)}
        dcp.load(trained, checkpoint_id=path)
        # Not strict: the frozen roles keep the weights they were built with, from their own paths.
        module.load_state_dict(trained["state_dict"], strict=False)
        for i, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer)}
            dcp.load(state, checkpoint_id=path)
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=options
            )
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def trained_state_dict(module: torch.nn.Module, cpu_offload: bool = True, **options: Any) -> dict[str, Any]:
    """The state dict of ``module`` without its frozen parameters (sharded unless ``full_state_dict``).

    ``ignore_frozen_params`` spares the frozen roles' shards (and, for a full state dict, their
    gathering), but keeps a frozen weight's tied alias (a reference's ``lm_head.weight``, the same
    tensor as its input embedding): the frozen names are taken with their aliases, as the module's
    own ``on_save_checkpoint`` does for single-file checkpoints.
    """
    options = StateDictOptions(cpu_offload=cpu_offload, ignore_frozen_params=True, **options)
    state = get_model_state_dict(module, options=options)
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen}


def install_sharded_checkpointing(strategy: Strategy) -> None:
    """Make Lightning's own ``ModelParallelStrategy`` save and load as :class:`AtomicModelParallelStrategy`.

    The Trainer built the strategy from the user's config, and its checkpoint methods are the only
    seam of folder checkpoints (``checkpoint_io`` is the seam of single files), so the instance takes
    the subclass, which adds methods and no state. A subclass of the user's own is left alone.
    """
    if type(strategy) is ModelParallelStrategy:
        strategy.__class__ = AtomicModelParallelStrategy


def first_failure(
    error: BaseException | None, world_size: int, folder: Path | None = None
) -> tuple[int, int | None, str] | None:
    """``(rank, errno, reason)`` of the lowest rank whose write failed, the same on every rank; None if
    every rank wrote its part. A collective: every rank calls it."""
    local = None if error is None else describe(error, folder)
    reports = [local] * world_size
    if world_size > 1:
        dist.all_gather_object(reports, local)
    for rank, report in enumerate(reports):
        if report is not None:
            return (rank, *report)
    return None


def describe(error: BaseException, folder: Path | None = None) -> tuple[int | None, str]:
    """``(errno, reason)`` of a failed write: the ``OSError`` behind it (also one that another rank
    hit inside the distributed writer); a full disk where the write was going (torch's zip writer
    reports a short write as ``RuntimeError: [enforce fail ...] unexpected pos``, no OSError); else
    the exception itself."""
    causes = [error]
    if isinstance(error, CheckpointException):  # the writer's failures of every rank, in rank order
        causes = [failure[0] for _, failure in sorted(error.failures.items())] + causes
    for cause in causes:
        os_error = os_error_in(cause)
        if os_error is not None:
            return os_error.errno, os_error.strerror or str(os_error)
    if folder is not None and _disk_full(folder):
        return errno.ENOSPC, os.strerror(errno.ENOSPC)
    return None, f"{type(error).__name__}: {error}".splitlines()[0]


def _disk_full(folder: Path) -> bool:
    """Whether the filesystem holding ``folder`` (or its nearest existing parent) has no room left."""
    path = folder
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < 64 * 1024
    except OSError:
        return False


def raise_save_failure(
    failure: tuple[int, int | None, str], error: BaseException | None, target: Path
) -> None:
    """Raise, on every rank, why the save of ``target`` failed, in the single-file saver's words."""
    rank, errno, reason = failure
    if errno is not None:
        raise save_error(OSError(errno, reason), target) from error
    if error is not None and not isinstance(error, Exception | CheckpointException):  # Ctrl-C, exit
        raise error
    left = f"the previous {target.name} is intact" if target.exists() else f"no {target.name} was written"
    raise RuntimeError(
        f"could not write checkpoint {target}: rank {rank} failed: {reason}; {left}"
    ) from error


def publish(temp: Path, target: Path) -> None:
    """Rename the complete folder ``temp`` to ``target`` and remove the checkpoint it replaces (rank 0).

    A folder cannot be renamed over a non-empty one, so the previous checkpoint is first renamed
    aside. Between the two renames there is no ``target``: a kill in that moment leaves the previous
    checkpoint complete under its ``old`` name (and the new one complete under its temporary name),
    never a half folder under ``target``; the next start renames the old one back
    (:func:`remove_stale_folders`). Until then ``--ckpt_path last`` finds no checkpoint, and the new
    run refuses to start over the restored ``last.ckpt``, so nothing is trained over it unasked.
    """
    fsync_folder(temp)  # its entries; the files themselves are synced
    old = None
    if target.exists() or target.is_symlink():
        old = side_folder(target, "old")
        os.rename(target, old)
    try:
        os.rename(temp, target)
        fsync_folder(target.parent)
    except BaseException:
        if old is not None and not target.exists():
            os.rename(old, target)
        raise
    if old is not None:  # the new checkpoint is in place: a leftover is cleared at the next start
        remove_path(old)


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree (a checkpoint of either kind), as far as it can."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_folders(folder: _PATH) -> list[Path]:
    """Clear what killed sharded saves left in ``folder``; returns the paths removed or restored.

    Only folders named like :func:`side_folder`'s whose writer (rank 0's host and pid) is gone are
    touched: a temporary folder is removed; a previous checkpoint moved aside is renamed back if its
    name is free (the kill came between the two renames of :func:`publish`), else removed. Folders
    of another host are left alone: their pid means nothing here.
    """
    if not _is_local_file_protocol(folder) or not os.path.isdir(folder):
        return []
    handled = []
    for path in sorted(Path(folder).iterdir()):
        match = _FOLDER_NAME.match(path.name)
        if match is None or not path.is_dir() or not _gone(f"{match['host']} {match['pid']}"):
            continue
        target = path.with_name(match["target"])
        if match["kind"] == "old" and not target.exists():
            os.rename(path, target)
        else:
            shutil.rmtree(path, ignore_errors=True)
        handled.append(path)
    if handled:
        rank_zero_info(f"cleared {len(handled)} folder(s) that killed checkpoint saves left in {folder}")
    return handled
