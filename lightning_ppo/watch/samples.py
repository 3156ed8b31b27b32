"""Sample tables on disk: what the policy wrote, one jsonl file per logged iteration.

``SampleTable`` writes ``<log folder>/samples/iteration_000100.jsonl``, one JSON object per sample
(iteration, prompt, completion, score, kl, then any column a reward added with ``log_extra``);
``lightning-ppo samples RUN_DIR`` prints the latest one, so the text of a run can be read without W&B.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLES_FOLDER = "samples"
COLUMNS = ("iteration", "prompt", "completion", "score", "kl")


@dataclass
class Samples:
    """The latest iteration's text, for sample tables (one entry per sequence): the module's
    ``last_samples``."""

    prompts: list[str]
    completions: list[str]
    scores: list[float]
    kl: list[float]
    extra: dict[str, list] = field(default_factory=dict)  # columns the rewards gave ``log_extra``


def sample_rows(
    iteration: int,
    prompts: Sequence[str],
    completions: Sequence[str],
    scores: Sequence[float],
    kl: Sequence[float],
    extra: dict[str, Sequence[Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per sample; a non-finite score (dropped by ``on_bad_reward: drop``, or scored by no
    reward) becomes ``None``. ``extra``: further columns, one value per sample (``log_extra``)."""
    extra = {name: values for name, values in (extra or {}).items() if name not in COLUMNS}
    return [
        {
            "iteration": iteration,
            "prompt": p,
            "completion": c,
            "score": s if math.isfinite(s) else None,
            "kl": k,
            **{name: values[i] for name, values in extra.items()},
        }
        for i, (p, c, s, k) in enumerate(zip(prompts, completions, scores, kl, strict=True))
    ]


def write_samples(log_dir: str | Path, iteration: int, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` to ``log_dir/samples/iteration_<iteration>.jsonl`` and return its path."""
    path = Path(log_dir) / SAMPLES_FOLDER / f"iteration_{iteration:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # A reward's log_extra column may hold values JSON has no type for: they are written as text.
    text = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")
    return path


def find_latest_samples(run_dir: str | Path) -> Path:
    """The most recently written samples file of a run: ``run_dir`` itself, or the newest under it.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or holds no samples file.
    """
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"run folder not found: {root}")
    if root.is_file():
        return root
    found = list(root.rglob(f"{SAMPLES_FOLDER}/iteration_*.jsonl"))
    if not found:
        raise FileNotFoundError(
            f"no {SAMPLES_FOLDER}/iteration_*.jsonl under {root}: add the "
            "lightning_ppo.callbacks.SampleTable callback to the run's trainer.callbacks"
        )
    return max(found, key=lambda p: (p.stat().st_mtime, p.name))


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one samples file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def format_samples(rows: list[dict[str, Any]]) -> str:
    """One line per sample: score, KL, and the prompt and completion as Python string literals
    (so whitespace, newlines and an empty completion are visible), then any extra column."""
    lines = []
    for row in rows:
        score = "   n/a" if row["score"] is None else f"{row['score']:6.3f}"
        extra = "".join(f"  {name}={value!r}" for name, value in row.items() if name not in COLUMNS)
        lines.append(f"score {score}  kl {row['kl']:7.3f}  {row['prompt']!r} -> {row['completion']!r}{extra}")
    return "\n".join(lines)
