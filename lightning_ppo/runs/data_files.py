"""Local data files in messages: why one could not be loaded, and where a bad row sits.

`datasets` reports a malformed or empty file as "An error occurred while generating the dataset",
a bare ``StopIteration`` or "Instruction 'train' corresponds to no data", none of which names the
file. :func:`find_problem` re-reads the files, only after such a failure, to say what is wrong.
A row that loads but cannot be used (a prompt that is not text) is named by :class:`RowOrigin` as
the user finds it: the file and its line (JSON Lines) or 1-based row, not an index into the
concatenation of the files that `datasets` loaded.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable
from dataclasses import dataclass
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
    for path in expand(files):
        problem = describe_file_problem(path, builder)
        if problem is not None:
            return problem
    return None


def expand(files: list[str]) -> list[str]:
    """The files behind ``files``, glob patterns expanded (sorted, as `datasets` reads them)."""
    paths: list[str] = []
    for pattern in files:
        is_pattern = any(c in pattern for c in "*?[")
        paths.extend(sorted(glob.glob(pattern, recursive=True)) if is_pattern else [pattern])
    return paths


def locate_row(files: list[str], builder: str, index: int) -> str | None:
    """Row ``index`` (0-based) of the rows `datasets` read from ``files`` in order, as ``'path' line
    N`` (JSON Lines: the line the row is on) or ``'path' row N`` (1-based); None when a file cannot
    be re-read here (compressed, remote, changed since)."""
    for path in expand(files):
        if "://" in path or path.lower().endswith(_COMPRESSION):
            return None
        try:
            rows = _reader(path, builder)[1](path)
        except (OSError, ValueError):
            return None
        if index < rows:
            line = _json_lines_line(path, index) if builder == "json" else None
            return f"{path!r} line {line}" if line is not None else f"{path!r} row {index + 1}"
        index -= rows
    return None


def _json_lines_line(path: str, index: int) -> int | None:
    """The line of row ``index`` of a JSON Lines file (blank lines hold no row); None for a JSON array."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return None
    rows = (number for number, line in enumerate(text.splitlines(), start=1) if line.strip())
    return next((number for i, number in enumerate(rows) if i == index), None)


@dataclass(frozen=True)
class RowOrigin:
    """Where the rows of one split came from, to name a row so that the user can find it.

    Args:
        label: the source as the user gave it: ``data.prompts``, ``the train split of 'org/set'``.
        files: local data files of the split, in the order they were read (patterns allowed).
        builder: their `datasets` builder (``json``, ``csv``, ``parquet``).
    """

    label: str
    files: tuple[str, ...] = ()
    builder: str = ""

    def row(self, index: int) -> str:
        """Row ``index`` (0-based, in the order loaded) as a file and line, or a 1-based row number."""
        located = locate_row(list(self.files), self.builder, index) if self.files else None
        return located or f"row {index + 1} of {self.label}"
