"""A run killed (SIGKILL) or interrupted (Ctrl-C) mid-training resumes from its last checkpoint to the
same result, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo.cli import main

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 30


def _args(policy: Path, root: Path, *callbacks: dict) -> list[str]:
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "dirpath": str(root / "ckpt")},
    }
    return [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy",
        str(policy),
        "--trainer.limit_train_batches",
        str(ITERATIONS),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.callbacks",
        json.dumps([saver, *callbacks]),
        "--trainer.val_check_interval",
        "null",
        "--trainer.check_val_every_n_epoch",
        "1",
        "--trainer.limit_val_batches",
        "0",
        "--data.init_args.batch_size",
        "8",
        "--data.init_args.num_prompts",
        "400",
    ]


def _saved_iteration(path: Path) -> int:
    try:
        return torch.load(path, weights_only=True)["ppo_state"]["iteration"]
    except (FileNotFoundError, RuntimeError, EOFError):
        return 0


@pytest.fixture(scope="module")
def reference(tiny_digits, tmp_path_factory):
    """The uninterrupted run, once for both kinds of interruption (seeded: the same every time)."""
    return main(_args(tiny_digits, tmp_path_factory.mktemp("reference"))).model


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_killed_run_resumes_to_the_uninterrupted_result(sig, reference, tiny_digits, tmp_path):

    root = tmp_path / "killed"
    throttle = {"class_path": "tests.helpers.Throttle", "init_args": {"seconds": 0.3}}
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lightning_ppo.cli", *_args(tiny_digits, root, throttle)]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = root / "ckpt" / "last.ckpt"
    deadline = time.monotonic() + 240
    while _saved_iteration(last) < 5 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(sig)
    process.wait(timeout=60)
    killed_at = _saved_iteration(last)
    assert 5 <= killed_at < ITERATIONS  # stopped mid-run, with a usable last checkpoint
    # whatever the moment of the kill, every checkpoint file left behind is complete
    for path in (root / "ckpt").glob("*.ckpt"):
        assert torch.load(path, weights_only=True)["state_dict"]

    resumed = main([*_args(tiny_digits, root), "--ckpt_path", "last"]).model
    assert resumed.iteration == reference.iteration == ITERATIONS
    for name, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
