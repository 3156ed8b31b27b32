"""What users watch: validation scores, the W&B samples table, written by a real offline run."""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning_ppo.cli import main
from lightning_ppo.wandb_offline import read_history

# What users watch, named as TRL names them (see the README's "Watching training").
EXPECTED_KEYS = (
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "val/ratio",
    "val/explained_variance",
    "returns/mean",
    "returns/std",
    "advantages/mean",
    "response/length_mean",
    "response/eos_fraction",
    "kl_coef",
    "lr",
    "episode",
)

ROOT = Path(__file__).resolve().parents[1]


def test_offline_wandb_run_gets_samples_table_and_eval_scores(tiny_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb_logger = {
        "class_path": "lightning.pytorch.loggers.WandbLogger",
        "init_args": {"save_dir": str(tmp_path), "offline": True, "project": "test"},
    }
    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--model.init_args.policy",
            str(tiny_digits),
            "--trainer.limit_train_batches",
            "4",
            "--trainer.val_check_interval",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.logger",
            json.dumps([wandb_logger]),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            json.dumps(
                [
                    {
                        "class_path": "lightning_ppo.callbacks.SampleTable",
                        "init_args": {"every_n_iterations": 2, "max_rows": 3},
                    }
                ]
            ),
            "--data.init_args.batch_size",
            "8",
            "--data.init_args.num_val_prompts",
            "8",
        ]
    )
    assert 0.0 <= float(cli.trainer.callback_metrics["eval/scores"]) <= 1.0
    cli.trainer.logger.experiment.finish()
    tables = sorted(tmp_path.rglob("samples_*.table.json"))
    assert len(tables) == 2  # iterations 2 and 4
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["iteration", "prompt", "completion", "score", "kl"]
    assert len(table["data"]) == 3 and all(row[1].endswith("=") for row in table["data"])
    # W&B's service process writes the run file in the background: give it a moment to catch up.
    deadline = time.monotonic() + 30
    history = read_history(tmp_path)
    while sum("objective/scores" in row for row in history) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
        history = read_history(tmp_path)
    train_rows = [row for row in history if "objective/scores" in row]
    assert len(train_rows) == 4  # one row per PPO iteration
    assert [row["iteration"] for row in train_rows] == [1.0, 2.0, 3.0, 4.0]
    for key in EXPECTED_KEYS:
        assert key in train_rows[-1], key
    assert any("eval/scores" in row for row in history)
