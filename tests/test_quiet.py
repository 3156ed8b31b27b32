"""A default quickstart fit prints none of the messages the package causes on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SILENCED = (
    "💡 Tip",  # Lightning's litlogger advertisement
    "LeafSpec",  # Lightning's deprecated torch pytree call
    "module(s) in eval mode",  # the frozen roles, in eval mode on purpose
    "anonymous setting",  # wandb's deprecation of an argument Lightning always passes
    "We strongly recommend passing in an `attention_mask`",  # transformers, inside generate
)


def _fit(policy: Path, root: Path, **env: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "lightning_ppo.cli",
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
    ]
    cmd += ["--model.init_args.policy", str(policy), "--trainer.default_root_dir", str(root)]
    cmd += ["--trainer.limit_train_batches", "3", "--trainer.val_check_interval", "2"]
    cmd += ["--data.init_args.batch_size", "8", "--trainer.enable_progress_bar", "false"]
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_quickstart_fit_prints_none_of_the_silenced_messages(tiny_digits, tmp_path):
    quiet = _fit(tiny_digits, tmp_path / "quiet")
    assert [m for m in SILENCED if m in quiet] == []
    assert "lightning_ppo summary: 3 PPO iterations" in quiet  # the run's own report stays
    # they are silenced, not absent: the verbose switch shows them (this is what the filters hide)
    loud = _fit(tiny_digits, tmp_path / "loud", LIGHTNING_PPO_VERBOSE="1")
    assert [m for m in SILENCED[:3] if m not in loud] == []
