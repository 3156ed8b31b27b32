"""Learning, end to end: a short quickstart run through the CLI raises the score."""

from __future__ import annotations

from pathlib import Path

from lightning_ppo.callbacks import TrainingSummary
from lightning_ppo.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_task_score_rises(tiny_digits, tmp_path):
    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--model.init_args.policy",
            str(tiny_digits),
            "--model.init_args.ppo.kl_coef",
            "0.02",
            "--trainer.limit_train_batches",
            "60",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            '[{"class_path": "lightning_ppo.callbacks.TrainingSummary"}]',
        ]
    )
    summary = next(cb for cb in cli.trainer.callbacks if isinstance(cb, TrainingSummary)).summary
    assert summary.iterations == 60
    # a random policy earns about 0.25; the first 6 iterations average below 0.4
    assert summary.first_score < 0.4
    assert summary.last_score > summary.first_score + 0.2
    assert summary.final_kl < 20.0
