"""Callbacks that report on a run: where its logs are, and whether the score rose."""

from __future__ import annotations

import time
from dataclasses import dataclass

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_ppo.runs.errors import UsageError
from lightning_ppo.watch.samples import sample_rows, write_samples


@dataclass
class RunSummary:
    """A run's mean score at its first iteration, over its first tenth, over its best window and over
    its last tenth (windows of a tenth of the iterations, at least one).

    The best window says what the run reached even when it lost it again (a KL pull-back, a
    collapse); first vs last alone hid that.
    """

    iterations: int
    start_score: float  # the first iteration's
    first_score: float
    best_score: float
    best_window: tuple[int, int]  # first and last iteration of the best window, 1-based
    last_score: float
    final_kl: float
    wall_seconds: float
    # diversity/top_share at the end: the share of prompts given the most common answer
    top_share: float | None = None

    def __str__(self) -> str:
        start, end = self.best_window
        answers = "" if self.top_share is None else f"; most common answer {self.top_share:.0%} of prompts"
        return (
            f"{self.iterations} PPO iterations in {self.wall_seconds:.0f} s: mean score "
            f"{self.start_score:.3f} (iteration 1), {self.first_score:.3f} (first 10 %), "
            f"{self.best_score:.3f} (best 10 %, iterations {start}-{end}), "
            f"{self.last_score:.3f} (last 10 %); final KL {self.final_kl:.3f}{answers}"
        )


def summarise(
    scores: list[float], final_kl: float, wall_seconds: float, top_share: float | None = None
) -> RunSummary:
    """The first score, and the means over the first, best and last tenth (at least one
    iteration each) of ``scores``."""
    tenth = max(1, len(scores) // 10)
    windows = [sum(scores[i : i + tenth]) / tenth for i in range(len(scores) - tenth + 1)]
    best = max(range(len(windows)), key=windows.__getitem__)
    return RunSummary(
        iterations=len(scores),
        start_score=scores[0],
        first_score=windows[0],
        best_score=windows[best],
        best_window=(best + 1, best + tenth),
        last_score=windows[-1],
        final_kl=final_kl,
        wall_seconds=wall_seconds,
        top_share=top_share,
    )


class TrainingSummary(Callback):
    """Prints where the logs go when training starts, and the run's :class:`RunSummary` at the end."""

    def __init__(self) -> None:
        self.scores: list[float] = []
        self.final_kl = float("nan")
        self.top_share: float | None = None
        self.summary: RunSummary | None = None
        self._start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        for logger in trainer.loggers:
            where = logger.log_dir or logger.save_dir
            rank_zero_info(f"lightning_ppo: logging to {type(logger).__name__} at {where}")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        metrics = trainer.callback_metrics
        if "objective/scores" in metrics:
            self.scores.append(float(metrics["objective/scores"]))
            self.final_kl = float(metrics["objective/kl"])
        if "diversity/top_share" in metrics:
            self.top_share = float(metrics["diversity/top_share"])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.scores:
            return
        seconds = time.perf_counter() - self._start
        self.summary = summarise(self.scores, self.final_kl, seconds, self.top_share)
        rank_zero_info(f"lightning_ppo summary: {self.summary}")


class SampleTable(Callback):
    """Every ``every_n_iterations`` PPO iterations, a table of samples, on disk and in W&B.

    Columns: iteration, prompt, completion, score (the reward's own), kl (the response's summed
    KL), then the columns rewards added with ``log_extra`` (TRL's convention) in that iteration.
    Each table is written to ``<log folder>/samples/iteration_000100.jsonl`` (the first logger's
    folder, or ``trainer.default_root_dir`` without one; ``lightning-ppo samples RUN_DIR`` prints the
    latest), and logged to every ``WandbLogger`` as ``samples/iteration_000100``, named by the
    iteration rather than by W&B's own step counter.

    Args:
        every_n_iterations: Write a table every this many iterations (>= 1).
        max_rows: Samples per table.
    """

    def __init__(self, every_n_iterations: int = 50, max_rows: int = 16) -> None:
        if every_n_iterations < 1 or max_rows < 1:
            raise UsageError(
                "SampleTable.every_n_iterations and SampleTable.max_rows must be >= 1, "
                f"got {every_n_iterations}, {max_rows}"
            )
        self.every_n_iterations, self.max_rows = every_n_iterations, max_rows

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        samples = getattr(pl_module, "last_samples", None)
        iteration = getattr(pl_module, "iteration", 0)
        if samples is None or iteration % self.every_n_iterations:
            return
        extra = getattr(samples, "extra", None)
        rows = sample_rows(iteration, samples.prompts, samples.completions, samples.scores, samples.kl, extra)
        rows = rows[: self.max_rows]
        log_dir = trainer.log_dir  # a collective under DDP: every rank asks
        if trainer.is_global_zero:
            write_samples(log_dir or trainer.default_root_dir, iteration, rows)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(
                    key=f"samples/iteration_{iteration:06d}",
                    columns=list(rows[0]),
                    data=[list(row.values()) for row in rows],
                )
