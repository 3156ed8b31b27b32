"""Why a local data file could not be loaded: which file, and a parse error with its line, or no rows.

`datasets` reports a malformed or empty file as "An error occurred while generating the dataset",
a bare ``StopIteration`` or "Instruction 'train' corresponds to no data", none of which names the
file. :func:`find_problem` re-reads the files, only after such a failure, to say what is wrong.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

# Compressed files are decompressed by `datasets` only; they are not diagnosed here.
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")


def _json_lines_rows(text: str) -> int:
    """Rows of a JSON Lines text: one JSON object per non-blank line."""
    rows = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"line {number}: {err.msg} (column {err.colno})") from err
        if not isinstance(row, dict):
            raise ValueError(f"line {number}: expected a JSON object, got {type(row).__name__}")
        rows += 1
    return rows


def _json_rows(path: str) -> int:
    """Rows of a .json file: a JSON array of objects, one object, or JSON Lines (`datasets` takes all)."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return _json_lines_rows(text)
    try:
        return len(json.loads(text))
    except json.JSONDecodeError as err:
        raise ValueError(f"line {err.lineno}: {err.msg} (column {err.colno})") from err


def _csv_rows(path: str) -> int:
    try:
        return len(pd.read_csv(path))
    except pd.errors.EmptyDataError:  # not even a header line
        return 0


def _parquet_rows(path: str) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def _reader(path: str, builder: str) -> tuple[str, Callable[[str], int]]:
    """What the file should be, for messages, and a function counting its rows."""
    if builder == "csv":
        return "valid CSV", _csv_rows
    if builder == "parquet":
        return "a readable Parquet file", _parquet_rows
    if path.lower().endswith(".jsonl"):
        return "valid JSON Lines", lambda p: _json_lines_rows(Path(p).read_text(encoding="utf-8"))
    return "valid JSON", _json_rows


def describe_file_problem(path: str, builder: str) -> str | None:
    """What is wrong with one local data file, or None when it reads fine."""
    if "://" in path or path.lower().endswith(_COMPRESSION):
        return None
    expected, count_rows = _reader(path, builder)
    try:
        rows = count_rows(path)
    except ValueError as err:  # includes UnicodeDecodeError and pyarrow's ArrowInvalid
        return f"data file {path!r} is not {expected}: {err}".rstrip()
    return f"data file {path!r} has no rows" if rows == 0 else None


def find_problem(files: list[str], builder: str) -> str | None:
    """The first problem among the data files (glob patterns expanded), or None when all read fine."""
    for pattern in files:
        is_pattern = any(c in pattern for c in "*?[")
        for path in sorted(glob.glob(pattern, recursive=True)) if is_pattern else [pattern]:
            problem = describe_file_problem(path, builder)
            if problem is not None:
                return problem
    return None
