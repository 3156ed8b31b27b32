"""Read the metrics history of an offline W&B run from its local ``run-*.wandb`` file.

An offline run (``WandbLogger(offline=True)``, no account needed) keeps everything in one
append-only file that ``wandb sync`` uploads later. Its layout is a LevelDB-style log: a 7-byte
header (``:W&B``, magic, version), then 32 KiB blocks of records, each with a 7-byte header
(CRC32, length, type: full / first / middle / last) around a serialized ``wandb.proto`` Record.
Reading it lets tests and plots use a real run without a server.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing the ':W&B' header)")
    records, partial, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a record header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 or pos + length > len(data):
            break  # the end, or a record still being written by a live run
        chunk, pos = data[pos : pos + length], pos + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            partial = chunk
        elif kind == _MIDDLE:
            partial += chunk
        elif kind == _LAST:
            records.append(partial + chunk)
    return records


def find_run_file(run_dir: str | Path) -> Path:
    """The newest ``run-*.wandb`` under ``run_dir`` (a run folder or any parent of one)."""
    files = sorted(Path(run_dir).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no offline W&B run (run-*.wandb) under {str(run_dir)!r}")
    return files[-1]


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every ``log`` call of the run written so far, in order, as ``{key: value}`` dicts."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(find_run_file(run_dir).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}
            )
    return rows
