"""Training curves from a run's ``CSVLogger`` log, drawn to a PNG (``lightning-ppo plot RUN_DIR``).

The x-axis is the logger's ``step`` column, which counts PPO iterations. Drawing uses the Agg
canvas directly, never ``pyplot``, so plotting changes no global matplotlib state (a notebook's
inline backend keeps working) and needs no display.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.csv"
STEP_COLUMN = "step"
DEFAULT_KEYS = (
    "objective/scores",
    "eval/scores",
    "objective/kl",
    "objective/entropy",
    "returns/mean",
    "policy/approxkl_avg",
    "loss/value_avg",
)
_MAX_COLUMNS = 3


def find_metrics_csv(run_dir: str | Path) -> Path:
    """The ``metrics.csv`` of a run: ``run_dir`` itself, or the newest one anywhere under it.

    Args:
        run_dir: A CSV file, a ``CSVLogger`` version folder, or any parent (e.g. ``runs/quickstart``).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or no ``metrics.csv`` lies under it.
    """
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"run folder not found: {root}")
    if root.is_file():
        return root
    found = sorted(root.rglob(METRICS_FILE), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        raise FileNotFoundError(
            f"no {METRICS_FILE} found under {root}: log the run with "
            "lightning.pytorch.loggers.CSVLogger, or pass the folder it writes to"
        )
    if len(found) > 1:
        log.info(
            "%d %s files under %s; plotting the most recent: %s", len(found), METRICS_FILE, root, found[0]
        )
    return found[0]


def read_metrics(path: str | Path) -> tuple[list[str], dict[str, tuple[list[float], list[float]]]]:
    """Every column of a ``CSVLogger`` log as ``(steps, values)``, skipping the rows where it is blank.

    Returns:
        ``(columns, series)``: the header in file order, and for each column other than ``step``
        with at least one number, its steps and values.
    """
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        if STEP_COLUMN not in columns:
            raise ValueError(f"{path} has no {STEP_COLUMN!r} column; columns present: {columns}")
        series: dict[str, tuple[list[float], list[float]]] = {}
        for row in reader:
            step = _number(row.get(STEP_COLUMN))
            if step is None:
                continue
            for key, text in row.items():
                value = _number(text)
                if key == STEP_COLUMN or key is None or value is None:
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(value)
    return columns, series


def _number(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        return None


def panel_keys(
    series: dict[str, tuple[list[float], list[float]]], keys: Sequence[str] | None = None
) -> list[str]:
    """The metrics drawn: ``keys`` (default :data:`DEFAULT_KEYS`) that have values in ``series``."""
    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    skipped = [key for key in wanted if key not in series]
    if skipped:
        log.info("no values for %s, skipped", skipped)
    return [key for key in wanted if key in series]


def run_name(run_dir: str | Path, metrics_csv: Path) -> str:
    """The run's folder name: ``run_dir``'s, above any logger folders (``csv/version_0``) it points into."""
    folder = Path(run_dir).resolve()
    if folder.is_file():
        folder = folder.parent
    logger_folders = {metrics_csv.parent.name, metrics_csv.parent.parent.name}
    while folder.name in logger_folders and folder.parent != folder:
        folder = folder.parent
    return folder.name


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start), same length as ``values``."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None, keys: Sequence[str] | None = None) -> Path:
    """Draw a grid of training curves from a run's ``metrics.csv`` and write it as a PNG.

    Args:
        run_dir: A ``CSVLogger`` version folder or any parent of one (the newest log under it is used).
        out: PNG path to write; default ``run_dir/curves.png``.
        keys: Logged metrics to draw, one panel each; default :data:`DEFAULT_KEYS` (``eval/scores``
            only drawn when the run validated). Keys the log does not have are skipped.

    Returns:
        The path of the PNG.

    Raises:
        FileNotFoundError: ``run_dir`` is missing or holds no ``metrics.csv``.
        ValueError: none of ``keys`` has a value in the log.
    """
    path = find_metrics_csv(run_dir)
    columns, series = read_metrics(path)
    present = panel_keys(series, keys)
    if not present:
        available = [c for c in columns if c != STEP_COLUMN]
        wanted = list(keys or DEFAULT_KEYS)
        raise ValueError(f"none of the keys {wanted} has values in {path}; available columns: {available}")

    ncols = min(_MAX_COLUMNS, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 2.9 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, key in zip(axes, present, strict=False):
        steps, values = series[key]
        window = max(1, len(values) // 20)
        ax.plot(steps, values, color="tab:blue", alpha=0.35 if window > 1 else 1.0, linewidth=1.0)
        if window > 1:
            ax.plot(steps, moving_average(values, window), color="tab:blue", linewidth=1.8)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    for ax in axes[len(present) :]:
        ax.set_axis_off()
    iterations = len(series[present[0]][0])
    fig.suptitle(f"{run_name(run_dir, path)}: {iterations} iterations ({path})", fontsize=9)

    if out is None:
        out = (Path(run_dir) if Path(run_dir).is_dir() else path.parent) / "curves.png"
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    log.info("wrote %s", target)
    return target
