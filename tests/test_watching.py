"""What users watch: validation scores, the W&B samples table, written by a real offline run."""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning_ppo.cli import main
from lightning_ppo.watch.samples import find_latest_samples, read_samples
from lightning_ppo.watch.wandb_offline import read_history

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
    "diversity/top_share",
    "diversity/distinct_1",
    "diversity/distinct_2",
    "diversity/overlap",
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
    # W&B tables are named by the PPO iteration, not by W&B's own step counter
    tables = sorted(tmp_path.rglob("media/table/samples/iteration_*.table.json"))
    assert [t.name.split("_")[1] for t in tables] == ["000002", "000004"]
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["iteration", "prompt", "completion", "score", "kl"]
    assert len(table["data"]) == 3 and all(row[1].endswith("=") for row in table["data"])
    assert all(row[0] == 4 for row in table["data"])
    # the same tables as jsonl in the run folder (the first logger's), for runs without W&B
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "iteration_000002.jsonl",
        "iteration_000004.jsonl",
    ]
    latest = find_latest_samples(tmp_path)
    rows = read_samples(latest)
    assert latest.name == "iteration_000004.jsonl"
    assert [[row[c] for c in table["columns"]] for row in rows] == table["data"]
    main(["samples", str(tmp_path), "--rows", "2"])
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
    eval_rows = [row for row in history if "eval/scores" in row]
    assert [row["iteration"] for row in eval_rows] == [2.0, 4.0]


def test_checkpoints_are_named_by_iteration(tiny_gpt2, tmp_path):
    import torch

    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
    from lightning_ppo.checkpoint import PPOCheckpoint
    from tests.helpers import CountCharReward, prompt_data, quiet_trainer

    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=4),
    )
    saver = PPOCheckpoint(every_n_iterations=2, monitor="objective/scores", mode="max", save_top_k=2)
    torch.manual_seed(0)
    # 3 iterations (the epoch's 3 batches): saved at iteration 2 (every_n) and 3 (epoch end)
    quiet_trainer(tmp_path, iterations=3, callbacks=[saver]).fit(module, datamodule=prompt_data())
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    # 4 optimizer steps per iteration: Lightning's default names would be epoch=0-step=8 and -step=12
    assert names == ["iteration=2.ckpt", "iteration=3.ckpt", "last.ckpt"]
