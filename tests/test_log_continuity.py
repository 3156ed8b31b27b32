"""A resumed run continues its first part's logs: one CSV version with every step once (rows logged
after the checkpoint give way to the resumed run's), its samples, and the same W&B run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import wandb
from lightning.pytorch import Trainer

from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.cli import main
from lightning_ppo.loggers import CSVLogger, WandbLogger
from lightning_ppo.runs.log_continuity import LOGS_KEY, continue_logs
from lightning_ppo.watch.plot import read_metrics
from lightning_ppo.watch.samples import find_latest_samples, read_samples
from tests.helpers import quickstart_fit_args, saver

STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2
LOGGERS = [
    {"class_path": "lightning_ppo.loggers.CSVLogger"},
    {
        "class_path": "lightning_ppo.loggers.WandbLogger",
        "init_args": {"project": "continuity", "offline": True},
    },
]


def _fit(policy: Path, root: Path, iterations: int, *extra: str):
    callbacks = [
        saver(every_n_iterations=2, save_top_k=-1),  # keeps iteration=2.ckpt, iteration=4.ckpt, ...
        {"class_path": "lightning_ppo.callbacks.SampleTable", "init_args": {"every_n_iterations": 2}},
    ]
    steps = ("--trainer.max_steps", str(iterations * STEPS_PER_ITERATION))
    args = quickstart_fit_args(
        policy, root, callbacks, *steps, "--trainer.logger", json.dumps(LOGGERS), *extra
    )
    try:
        return main(args)
    finally:
        wandb.finish()  # an in-process run stays open, and the next fit's WandbLogger would join it


def _wandb_ids(root: Path) -> list[str]:
    """The run id of each offline run folder (``offline-run-<time>-<id>[-<n>]``), oldest first."""
    return [p.stem.removeprefix("run-") for p in sorted((root / "wandb").glob("offline-run-*/run-*.wandb"))]


def _steps(metrics_csv: Path, column: str) -> list[int]:
    with metrics_csv.open(newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row[column]]


def test_a_resumed_run_continues_the_csv_version_samples_and_wandb_run(tiny_digits, tmp_path):
    first = _fit(tiny_digits, tmp_path, 4)
    run_id = first.trainer.loggers[1].version
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)[LOGS_KEY]
    assert [r["kind"] for r in saved] == ["csv", "wandb"] and saved[1]["id"] == run_id

    # Resumed from iteration 2: the first run's rows of iterations 3 and 4 were logged after that
    # checkpoint, and the resumed run logs those iterations again.
    from_two = str(tmp_path / "checkpoints" / "iteration=2.ckpt")
    _fit(tiny_digits, tmp_path, 6, "--ckpt_path", from_two)
    last = _fit(tiny_digits, tmp_path, 8, "--ckpt_path", "last")
    assert last.model.iteration == 8

    assert [p.name for p in (tmp_path / "csv").iterdir()] == ["version_0"]
    metrics = tmp_path / "csv" / "version_0" / "metrics.csv"
    # The logger's step counts iterations from 0: iterations 1..8 are steps 0..7, each once.
    assert _steps(metrics, "objective/scores") == list(range(8))
    _, series = read_metrics(metrics)
    steps, scores = series["objective/scores"]
    assert steps == [float(s) for s in range(8)] and len(scores) == 8
    assert series["iteration"][1] == [float(i) for i in range(1, 9)]

    samples = sorted(p.name for p in (tmp_path / "csv" / "version_0" / "samples").iterdir())
    assert samples == [f"iteration_{i:06d}.jsonl" for i in (2, 4, 6, 8)]
    assert read_samples(find_latest_samples(tmp_path))[0]["iteration"] == 8

    assert _wandb_ids(tmp_path) == [run_id] * 3  # W&B writes a folder per resume, all of one run


def test_a_logger_given_its_own_version_or_id_keeps_it(tmp_path):
    csv_logger = CSVLogger(save_dir=str(tmp_path), version="mine")
    csv_logger.continue_log(0)
    assert csv_logger.version == "mine"
    wandb_logger = WandbLogger(save_dir=str(tmp_path), id="mine", offline=True)
    wandb_logger.continue_run("theirs")
    assert wandb_logger.version == "mine"

    unset = WandbLogger(save_dir=str(tmp_path), offline=True)
    unset.continue_run("theirs")
    assert unset.version == "theirs"


def _write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=sorted(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_a_continued_csv_log_replaces_the_rows_from_its_first_step_on(tmp_path):
    metrics = tmp_path / "csv" / "version_3" / "metrics.csv"
    _write_csv(metrics, [{"step": s, "loss": 10.0 + s} for s in range(6)])
    logger = CSVLogger(save_dir=str(tmp_path))
    logger.continue_log(3)
    logger.log_metrics({"loss": 0.5}, step=4)
    logger.log_metrics({"loss": 0.25, "eval/scores": 1.0}, step=5)  # a new column
    logger.save()

    with metrics.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [
        (0, 10.0),
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 0.5),
        (5, 0.25),
    ]
    assert [r["eval/scores"] for r in rows] == ["", "", "", "", "", "1.0"]


@pytest.mark.parametrize("ckpt_path", [None, "best", "last"])
def test_without_a_checkpoint_to_resume_a_run_logs_to_a_new_version(ckpt_path, tmp_path):
    _write_csv(tmp_path / "csv" / "version_0" / "metrics.csv", [{"step": 0, "loss": 1.0}])
    logger = CSVLogger(save_dir=str(tmp_path))
    trainer = Trainer(logger=logger, default_root_dir=tmp_path, callbacks=[PPOCheckpoint()])
    continue_logs(trainer, ckpt_path)  # "last": there is no last.ckpt
    assert logger.version == 1
