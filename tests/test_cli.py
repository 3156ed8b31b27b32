"""The lightning-ppo command, in-process: fit from a config, a subclass by class_path, make-tiny."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import wandb

from lightning_ppo.cli import main
from tests.helpers import ShortAnswerModule, cli_usage_error

ROOT = Path(__file__).resolve().parents[1]
# Multi-process configs (fsdp2.yaml) run as subprocesses in tests/test_fsdp2.py: in-process, Lightning's
# launcher would start copies of pytest. The GSM8K configs name a hub model and dataset and a GPU:
# tests/test_gsm8k.py runs them offline, on a tiny Qwen2 and files in GSM8K's format.
CONFIGS = [
    c
    for c in sorted((ROOT / "configs").glob("*.yaml"))
    if "devices: 2" not in c.read_text() and not c.stem.startswith("gsm8k")
]


def _csv_logger(tmp_path: Path) -> str:
    init_args = {"save_dir": str(tmp_path), "name": "csv"}
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": init_args}
    return json.dumps([logger])


def _short_run(config: Path, policy: Path, tmp_path: Path, *extra: str):
    return main(
        [
            "fit",
            "--config",
            str(config),
            "--model.init_args.policy",
            str(policy),
            "--trainer.limit_train_batches",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.logger",
            _csv_logger(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.enable_checkpointing",
            "false",
            "--data.init_args.batch_size",
            "8",
            *extra,
        ]
    )


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_fits_in_process(config, tiny_gpt2, tiny_reward, tmp_path):
    text = config.read_text()
    extra = ["--model.init_args.reward_model", str(tiny_reward)] if "reward_model:" in text else []
    extra += ["--model.init_args.reference", str(tiny_gpt2)] if "reference:" in text else []
    cli = _short_run(config, tiny_gpt2, tmp_path, *extra)
    ppo = cli.model.ppo
    assert cli.trainer.global_step == 2 * ppo.ppo_epochs * ppo.num_minibatches
    rows = list(csv.DictReader((Path(cli.trainer.logger.log_dir) / "metrics.csv").open()))
    assert len(rows) == 2 and float(rows[-1]["episode"]) == 2 * 8 * ppo.num_generations
    # a critic-free estimator builds no value model and trains nothing but the policy
    assert cli.model.roles.has_critic == (ppo.advantage_estimator == "gae")
    if len(cli.model.reward_fns) > 1:
        names = [key for key in rows[-1] if key.startswith("reward/") and key != "reward/dropped"]
        assert sorted(names) == ["reward/DigitsReward", "reward/exact_length"]
    assert (tmp_path / "config.yaml").exists() or any(tmp_path.rglob("config.yaml"))


def test_subclass_with_custom_score_by_class_path(tiny_gpt2, tmp_path):
    ShortAnswerModule.seen_extras.clear()
    cli = _short_run(
        ROOT / "configs" / "quickstart.yaml",
        tiny_gpt2,
        tmp_path,
        "--model.class_path",
        "tests.helpers.ShortAnswerModule",
    )
    assert isinstance(cli.model, ShortAnswerModule)
    # the quickstart's reward_fn is still configured, but the subclass's score() decides
    assert len(ShortAnswerModule.seen_extras) == 2
    assert len(ShortAnswerModule.seen_extras[0]["target"]) == 8  # extra dataset column reached score()


def test_a_reward_module_in_the_working_directory_imports_as_under_python_m(
    tiny_gpt2, tmp_path, monkeypatch, request
):
    """The console script's sys.path[0] is its bin folder: `main` adds the working directory itself."""
    (tmp_path / "cwd_reward.py").write_text(
        "class QuarterReward:\n"
        "    def __call__(self, prompts, completions, batch):\n"
        "        return [0.25 for _ in completions]\n"
    )
    config = "model:\n  init_args:\n    reward_fn: {class_path: cwd_reward.QuarterReward}\n"
    (tmp_path / "reward.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    # as under the console script: neither "" nor the working directory on the path
    here = os.path.realpath(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.realpath(p) != here])
    request.addfinalizer(lambda: sys.modules.pop("cwd_reward", None))
    cli = _short_run(ROOT / "configs" / "quickstart.yaml", tiny_gpt2, tmp_path, "--config", "reward.yaml")
    assert [type(fn).__module__ for fn in cli.model.reward_fns] == ["cwd_reward"]
    rows = list(csv.DictReader((Path(cli.trainer.logger.log_dir) / "metrics.csv").open()))
    assert [float(row["objective/scores"]) for row in rows] == [0.25, 0.25]


def test_help_exits_cleanly():
    for args in (["--help"], ["fit", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 0


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    main(["make-tiny", "--out", str(tmp_path / "m"), "--arch", "llama", "--alphabet", "0123456789="])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == 14 and model.config.vocab_size == 14
    assert tokenizer.decode(tokenizer("12=")["input_ids"]) == "12="


def test_default_root_dir_holds_the_whole_run(tiny_digits, tmp_path, monkeypatch, capsys):
    """Logs and checkpoints follow --trainer.default_root_dir; a second new run there is refused."""
    monkeypatch.chdir(tmp_path)  # anything written outside the root would land here
    root = tmp_path / "elsewhere"
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy",
        str(tiny_digits),
        *("--trainer.limit_train_batches", "2", "--trainer.default_root_dir", str(root)),
        *("--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", "null"),
        *("--trainer.limit_val_batches", "0", "--data.init_args.batch_size", "8"),
        *("--data.init_args.num_prompts", "64"),
    ]
    main(args)
    wandb.finish()  # an in-process run stays open, and a later test's WandbLogger would join it
    assert (root / "checkpoints" / "last.ckpt").exists()
    assert (root / "csv" / "version_0" / "metrics.csv").exists()
    assert any((root / "wandb").glob("offline-run-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]
    saved = sorted(p.name for p in (root / "checkpoints").iterdir())

    assert "last.ckpt belongs to an earlier run" in cli_usage_error(capsys, args)
    wandb.finish()
    # refused before any training: the first run's checkpoint is untouched and nothing was added
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == saved
    assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["ppo_state"]["iteration"] == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        # a list replaces the config's callbacks, PPOCheckpoint included
        ([json.dumps([{"class_path": "lightning_ppo.callbacks.SampleTable"}])], ["SampleTable"]),
        # `+=` appends one callback to them
        (
            ['--trainer.callbacks+={"class_path": "lightning_ppo.callbacks.SampleTable"}'],
            ["TrainingSummary", "SampleTable", "SampleTable", "PPOCheckpoint"],
        ),
        # an empty list removes them all
        (["[]"], []),
    ],
    ids=["list-replaces", "plus-appends", "empty-clears"],
)
def test_callbacks_on_the_command_line_replace_or_append_as_the_readme_says(
    given, expected, tiny_digits, tmp_path
):
    from lightning_ppo import PPOLightningModule, PromptDataModule
    from lightning_ppo.cli import PPOLightningCLI

    args = [
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy",
        str(tiny_digits),
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    args += given if given[0].startswith("--") else ["--trainer.callbacks", *given]
    cli = PPOLightningCLI(
        PPOLightningModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=False,
    )
    ours = [
        type(cb).__name__ for cb in cli.trainer.callbacks if type(cb).__module__.startswith("lightning_ppo")
    ]
    assert ours == expected
