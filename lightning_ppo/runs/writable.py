"""Output folders checked before any work: an unwritable checkpoint or log folder should stop a run
at its start, not at its first save after an hour of training."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH

from lightning_ppo.runs.errors import UsageError


class UnwritableFolderError(UsageError, OSError):
    """An output folder that cannot be created or written; the message names it and its setting."""


def ensure_writable(folder: _PATH, setting: str) -> None:
    """Create ``folder`` if missing and check a file can be written in it, or raise
    :class:`UnwritableFolderError` naming ``folder`` and ``setting`` (the config field that set it).

    A real file is created rather than asking ``os.access``: root passes any permission check but
    still cannot write under a regular file, on a read-only mount or in ``/proc``. Remote paths
    (``s3://``, ...) are not checked.
    """
    if not _is_local_file_protocol(folder):
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(folder) else ""
        raise UnwritableFolderError(f"{setting}: cannot write to {folder}: {reason}{where}") from err


def configured_folders(config: Namespace) -> Iterator[tuple[str, str]]:
    """(config field, folder) for every local output folder a parsed ``fit``/``validate`` config names:
    ``trainer.default_root_dir``, each logger's ``save_dir`` and each callback's ``dirpath``."""
    root = config.get("trainer.default_root_dir")
    if root is not None:
        yield "trainer.default_root_dir", str(root)
    for field, key in (("trainer.logger", "save_dir"), ("trainer.callbacks", "dirpath")):
        for name, item in class_configs(field, config.get(field)):
            folder = item.get(f"init_args.{key}")
            if folder is not None:
                yield f"{name}.init_args.{key}", str(folder)


def check_configured_folders(config: Namespace) -> None:
    """Raise :class:`UnwritableFolderError` for the first configured output folder that cannot be written."""
    for setting, folder in configured_folders(config):
        ensure_writable(folder, setting)


def class_configs(field: str, value: object) -> Iterator[tuple[str, Namespace]]:
    """The ``class_path``/``init_args`` entries of a field that holds one of them or a list of them
    (``trainer.logger`` may also be a bool)."""
    if isinstance(value, Namespace):
        yield field, value
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, Namespace):
                yield f"{field}[{index}]", item
