"""A resumed run logs where its first part did: the same CSV version folder, the same W&B run.

Every checkpoint :class:`~lightning_ppo.checkpoint.PPOCheckpoint` writes records where its run logs
(:func:`logger_records`: each CSV logger's folder and version, each W&B logger's project and run
id). ``lightning-ppo fit --ckpt_path`` reads that record back right before ``trainer.fit``
(:func:`continue_logs`) and points the loggers of the resumed run at the same places, so
``lightning-ppo plot`` and ``lightning-ppo samples`` show one run, and W&B one curve.

Why in the checkpoint, not in a file beside it: the ids belong to the run that wrote that checkpoint
and travel with it (a copied checkpoint, or one passed by path, still carries them), and no second
file can disagree with it. Reading them costs a memory-mapped load of the file's structure, as the
CLI's check of ``ckpt_path`` does already. Why before ``fit`` rather than in a callback's
``load_state_dict``: Lightning creates the loggers' experiments (the version folder, the W&B run)
at the start of ``fit``, before it restores anything from the checkpoint.

In Python, call ``continue_logs(trainer, ckpt_path)`` before ``trainer.fit(..., ckpt_path=...)``.
A logger given its own ``version`` (CSV) or ``id`` (W&B) keeps it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch import Trainer
from lightning.pytorch import loggers as pl_loggers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_ppo._moved import old_paths_allowed

LOGS_KEY = "lightning_ppo_logs"  # the checkpoint's entry: a list of plain dicts (weights_only loads it)


def logger_records(loggers: Sequence[Logger]) -> list[dict[str, Any]]:
    """Where each CSV and W&B logger writes, in plain types: what a resumed run needs to continue it."""
    records: list[dict[str, Any]] = []
    for logger in loggers:
        if isinstance(logger, pl_loggers.CSVLogger):
            records.append({"kind": "csv", "root_dir": _real(logger.root_dir), "version": logger.version})
        elif isinstance(logger, pl_loggers.WandbLogger) and logger.version:
            records.append({"kind": "wandb", "project": logger.name, "id": str(logger.version)})
    return records


def continue_logs(trainer: Trainer, ckpt_path: str | os.PathLike | None) -> None:
    """Point ``trainer``'s loggers at the logs of the run that wrote the checkpoint ``ckpt_path``.

    A CSV logger continues the version it wrote to when it writes to the same folder; a W&B logger
    continues the run of the same project. Nothing changes without a checkpoint, or for one that
    holds no record (written before this existed, or without ``PPOCheckpoint``).
    """
    path = checkpoint_to_load(trainer, ckpt_path)
    records = read_logger_records(path) if path is not None else []
    for logger in trainer.loggers:
        # Duck-typed: ``lightning_ppo.loggers`` (the public face) has the loggers that can continue.
        if isinstance(logger, pl_loggers.CSVLogger) and hasattr(logger, "continue_log"):
            found = _find(records, kind="csv", root_dir=_real(logger.root_dir))
            if found is not None:
                logger.continue_log(found["version"])
        elif isinstance(logger, pl_loggers.WandbLogger) and hasattr(logger, "continue_run"):
            found = _find(records, kind="wandb", project=logger.name)
            if found is not None:
                logger.continue_run(found["id"])


def checkpoint_to_load(trainer: Trainer, ckpt_path: str | os.PathLike | None) -> Path | None:
    """The checkpoint ``trainer.fit(ckpt_path=...)`` will load, ``last`` found as Lightning finds it:
    the newest ``last`` checkpoint of the checkpoint callbacks. ``None`` for none, and for the
    other special values and remote paths (their logs are not continued)."""
    if ckpt_path is None:
        return None
    text = os.fspath(ckpt_path)
    if text in ("best", "hpc") or text.startswith("registry:") or "://" in text:
        return None
    if text != "last":
        return Path(text)
    candidates: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    existing = [c for c in candidates if os.path.exists(c)]
    return Path(max(existing, key=os.path.getmtime)) if existing else None


def read_logger_records(path: Path) -> list[dict[str, Any]]:
    """The record of a checkpoint file or sharded checkpoint folder; ``[]`` where it has none."""
    file = path / _METADATA_FILENAME if path.is_dir() else path
    try:
        # Memory-mapped: the weights stay on disk, only the small entries are read.
        with old_paths_allowed():  # what Lightning's load of it reads (runs.checkpoint_io)
            checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not readable here: Lightning's own load of it will say why
        return []
    records = checkpoint.get(LOGS_KEY, []) if isinstance(checkpoint, dict) else []
    return [r for r in records if isinstance(r, dict)]


def _find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in records if all(r.get(k) == v for k, v in match.items())), None)


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.fspath(path))
