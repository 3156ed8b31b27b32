"""A run killed (SIGKILL) or interrupted (Ctrl-C) mid-training resumes from its last checkpoint to the
same result, bit for bit."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo.cli import main
from tests.helpers import quickstart_fit_args, saver, start_forked

ITERATIONS = 30


def _args(policy: Path, root: Path, *callbacks: dict, every: int = 1) -> list[str]:
    checkpoints = saver(every_n_iterations=every, dirpath=str(root / "ckpt"))
    return quickstart_fit_args(
        policy, root, [checkpoints, *callbacks], "--trainer.limit_train_batches", str(ITERATIONS)
    )


def _saved_iteration(path: Path) -> int:
    try:
        return torch.load(path, weights_only=True)["ppo_state"]["iteration"]
    except (FileNotFoundError, RuntimeError, EOFError):
        return 0


@pytest.fixture(scope="module")
def reference(tiny_digits, tmp_path_factory):
    """The uninterrupted run, once for both kinds of interruption (seeded: the same every time)."""
    return main(_args(tiny_digits, tmp_path_factory.mktemp("reference"))).model


# SIGKILL: the run saves every iteration and is killed at any moment. Ctrl-C: the run would save only
# every 1000 iterations, so the checkpoint it leaves is the one Ctrl-C itself writes.
@pytest.mark.long  # two fits and a resume each, 15-30 s
@pytest.mark.parametrize(
    ("sig", "every"), [(signal.SIGKILL, 1), (signal.SIGINT, 1000)], ids=["SIGKILL", "Ctrl-C"]
)
def test_killed_run_resumes_to_the_uninterrupted_result(sig, every, reference, tiny_digits, tmp_path):
    root = tmp_path / "killed"
    progress = tmp_path / "progress"
    throttle = {
        "class_path": "tests.helpers.Throttle",
        "init_args": {"seconds": 0.3, "progress_file": str(progress)},
    }
    output = tmp_path / "output.txt"
    with open(output, "w") as out:
        process = start_forked(
            _args(tiny_digits, root, throttle, every=every), stdout=out, stderr=subprocess.STDOUT
        )
    last = root / "ckpt" / "last.ckpt"
    deadline = time.monotonic() + 240
    while _done(progress) < 6 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(sig)
    code = process.wait(timeout=60)
    killed_at = _saved_iteration(last)
    assert 5 <= killed_at < ITERATIONS  # stopped mid-run, with a usable last checkpoint
    if sig == signal.SIGINT:
        assert code == 130  # saved and stopped, but not a finished run
        assert killed_at >= _done(progress) - 1  # the iteration under way when Ctrl-C came is saved
        said = output.read_text()
        assert f"Ctrl-C: saving iteration {killed_at} to" in said and "Traceback" not in said
        assert "max_epochs=1` reached" not in said  # Lightning's words for an epoch that did not end
    # whatever the moment of the kill, every checkpoint file left behind is complete
    for path in (root / "ckpt").glob("*.ckpt"):
        assert torch.load(path, weights_only=True)["state_dict"]

    resumed = main([*_args(tiny_digits, root, every=every), "--ckpt_path", "last"]).model
    assert resumed.iteration == reference.iteration == ITERATIONS
    for name, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def _done(progress: Path) -> int:
    """Iterations the running process has finished (its Throttle writes the count)."""
    try:
        return int(progress.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0
