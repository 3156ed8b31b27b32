"""A default quickstart fit prints none of the messages the package causes on purpose."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import forked_cli_process

ROOT = Path(__file__).resolve().parents[1]
SILENCED = (
    "💡 Tip",  # Lightning's litlogger advertisement
    "LeafSpec",  # Lightning's deprecated torch pytree call
    "module(s) in eval mode",  # the frozen roles, in eval mode on purpose
    "anonymous setting",  # wandb's deprecation of an argument Lightning always passes
    "We strongly recommend passing in an `attention_mask`",  # transformers, inside generate
)


def _fit(policy: Path, root: Path, **env: str) -> str:
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy",
        str(policy),
    ]
    args += ["--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.limit_train_batches", "3", "--trainer.val_check_interval", "2"]
    done = forked_cli_process([*args, "--data.init_args.batch_size", "8"], WANDB_MODE="offline", **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_quickstart_fit_prints_none_of_the_silenced_messages(tiny_digits, tmp_path):
    quiet = _fit(tiny_digits, tmp_path / "quiet")
    assert [m for m in SILENCED if m in quiet] == []
    assert "lightning_ppo summary: 3 PPO iterations" in quiet  # the run's own report stays
    # they are silenced, not absent: the verbose switch shows them (this is what the filters hide)
    loud = _fit(tiny_digits, tmp_path / "loud", LIGHTNING_PPO_VERBOSE="1")
    assert [m for m in SILENCED[:3] if m not in loud] == []


def test_a_many_core_machine_hears_no_advice_about_dataloader_workers(tiny_digits, monkeypatch):
    """On a GPU machine of 16 cores Lightning advised more DataLoader workers, for the train and the
    val loader; here a prompt batch is a few token rows and num_workers 0 keeps resume exact."""
    from lightning.pytorch.trainer.connectors import data_connector

    from lightning_ppo.module import PPOLightningModule
    from lightning_ppo.runs import quiet
    from tests.helpers import CountCharReward, fit_warnings, prompt_data

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 15)  # 16 cores
    advice = "does not have many workers"
    heard = {}
    for verbose in ("1", "0"):  # verbose first: the patched machine does make Lightning say it
        monkeypatch.setenv(quiet.VERBOSE_ENV, verbose)
        monkeypatch.setattr(quiet, "_installed", False)
        module = PPOLightningModule(str(tiny_digits), reward_fn=CountCharReward())
        heard[verbose] = [m for m in fit_warnings(module, prompt_data(4), 1) if advice in m]
    assert heard["1"] and heard["0"] == []
