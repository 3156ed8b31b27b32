"""The loggers continue a run's logs: a continued CSV log keeps the rows before the steps it logs
again; a logger given its own version or id keeps it."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning_ppo.loggers import CSVLogger, WandbLogger


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
