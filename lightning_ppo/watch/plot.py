"""Training curves from a run's ``CSVLogger`` log, drawn to a PNG (``lightning-ppo plot RUN_DIR``).

The x-axis is the logger's ``step`` column, which counts PPO iterations, except in the frontier
panel (:data:`FRONTIER`): score against KL, the reward-KL trade-off the run has made so far, which
answers "which KL should I allow?" (where the curve flattens, more KL buys no more score). Drawing
uses the Agg
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
FRONTIER = "frontier"  # not a logged column: objective/scores drawn against objective/kl
FRONTIER_AXES = ("objective/kl", "objective/scores")
DEFAULT_KEYS = (
    "objective/scores",
    "eval/scores",
    "objective/kl",
    FRONTIER,
    "kl_coef",
    "objective/entropy",
    "diversity/top_share",
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
    """The panels drawn: ``keys`` (default :data:`DEFAULT_KEYS`) that have values in ``series``.

    By default ``kl_coef`` is drawn only when it moved (an adaptive controller, ``kl_target``): a
    fixed coefficient is a flat line that takes a panel to say what the config says.
    """
    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    if not keys and "kl_coef" in series and len(set(series["kl_coef"][1])) <= 1:
        wanted.remove("kl_coef")
    present = [key for key in wanted if _has_values(series, key)]
    skipped = [key for key in wanted if key not in present]
    if skipped:
        log.info("no values for %s, skipped", skipped)
    return present


def _has_values(series: dict[str, tuple[list[float], list[float]]], key: str) -> bool:
    if key == FRONTIER:
        return all(axis in series for axis in FRONTIER_AXES)
    return key in series


def frontier(
    series: dict[str, tuple[list[float], list[float]]], window: int
) -> tuple[list[float], list[float], list[float]]:
    """``(kl, score, step)`` of the frontier panel: both smoothed over ``window`` iterations, on
    the steps that logged both (one noisy batch is not where the run stood)."""
    kl_steps, kl_values = series[FRONTIER_AXES[0]]
    score_steps, score_values = series[FRONTIER_AXES[1]]
    kl_at = dict(zip(kl_steps, kl_values, strict=True))
    steps = [step for step in score_steps if step in kl_at]
    scores_at = dict(zip(score_steps, score_values, strict=True))
    kl = moving_average([kl_at[step] for step in steps], window)
    score = moving_average([scores_at[step] for step in steps], window)
    return kl, score, steps


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
        if key == FRONTIER:
            _draw_frontier(fig, ax, series)
        else:
            _draw_curve(ax, key, *series[key])
        ax.grid(alpha=0.3)
    for ax in axes[len(present) :]:
        ax.set_axis_off()
    iterations = max(len(series[key][0]) for key in (*present, *FRONTIER_AXES) if key in series)
    fig.suptitle(f"{run_name(run_dir, path)}: {iterations} iterations ({path})", fontsize=9)

    if out is None:
        out = (Path(run_dir) if Path(run_dir).is_dir() else path.parent) / "curves.png"
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    log.info("wrote %s", target)
    return target


def _draw_curve(ax, key: str, steps: list[float], values: list[float]) -> None:
    """One metric over PPO iterations: raw (faint) and a trailing mean over a 20th of the run."""
    window = max(1, len(values) // 20)
    ax.plot(steps, values, color="tab:blue", alpha=0.35 if window > 1 else 1.0, linewidth=1.0)
    if window > 1:
        ax.plot(steps, moving_average(values, window), color="tab:blue", linewidth=1.8)
    ax.set_title(key, fontsize=10)
    ax.set_xlabel("PPO iteration")


def _draw_frontier(fig: Figure, ax, series: dict[str, tuple[list[float], list[float]]]) -> None:
    """Smoothed score against smoothed KL, coloured by iteration: the trade-off made so far."""
    kl, score, steps = frontier(series, max(1, len(series[FRONTIER_AXES[1]][0]) // 20))
    ax.plot(kl, score, color="0.7", linewidth=0.8)
    points = ax.scatter(kl, score, c=steps, cmap="viridis", s=6)
    fig.colorbar(points, ax=ax, label="PPO iteration")
    ax.set_title("objective/scores against objective/kl", fontsize=10)
    ax.set_xlabel("objective/kl (KL per response)")
