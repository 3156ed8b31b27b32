"""What a run says and leaves behind in the cases where Lightning's own words or habits contradicted
the package (issue 19, items 6, 10 and 11): a moved run folder, warnings that do not apply, Ctrl-C
at start-up, field names without their section, row numbers, the prompt the reward sees."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo.cli import main
from tests.helpers import cli_process, quickstart_fit_args, saver

ROOT = Path(__file__).resolve().parents[1]

STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2


def _run_args(policy: Path, root: Path, iterations: int, *extra: str) -> list[str]:
    """The quickstart for ``iterations`` PPO iterations (a step limit: resumable), its checkpoints in
    ``root/checkpoints`` (the default folder), the best kept by score."""
    checkpoints = saver(every_n_iterations=1, monitor="objective/scores", mode="max", save_top_k=1)
    steps = ("--trainer.max_steps", str(iterations * STEPS_PER_ITERATION))
    return quickstart_fit_args(policy, root, [checkpoints], *steps, *extra, prompts=64)


def _iteration(path: Path) -> int:
    return torch.load(path, weights_only=True)["ppo_state"]["iteration"]


def test_a_moved_run_folder_resumes_into_its_own_last_ckpt(tiny_digits, tmp_path):
    """Item 6: Lightning forgets a checkpoint folder's files when its path changed and wrote
    ``last-v1.ckpt`` beside the moved ``last.ckpt``; a resumed run now overwrites its own."""
    main(_run_args(tiny_digits, tmp_path / "first", 2))
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    main([*_run_args(tiny_digits, moved, 3), "--ckpt_path", "last"])
    files = sorted(p.name for p in (moved / "checkpoints").glob("*.ckpt"))
    assert "last-v1.ckpt" not in files and len(files) == 2, files  # last.ckpt and one best (top-1)
    assert _iteration(moved / "checkpoints" / "last.ckpt") == 3


def test_a_run_says_nothing_that_is_false_for_it(tiny_digits, tmp_path):
    """Item 10: ``--ckpt_path last`` with nothing on disk starts a new run and says so plainly (not
    Lightning's hint about ``save_last``); no validation set is no "zero length" alarm; an exact
    mid-epoch resume is no "unreliable results"."""
    args = [
        *_run_args(tiny_digits, tmp_path, 2),
        "--data.init_args.num_val_prompts",
        "0",
        "--ckpt_path",
        "last",
    ]
    first = cli_process(args)
    assert first.returncode == 0, first.stderr[-3000:]
    said = first.stdout + first.stderr
    nothing = (
        f"--ckpt_path last: no last.ckpt in {os.path.realpath(tmp_path / 'checkpoints')}: nothing to resume"
    )
    assert said.count(f"lightning_ppo: {nothing}; starting a new run") == 1
    assert "no last checkpoint available" not in said and "across ranks is zero" not in said
    assert _iteration(tmp_path / "checkpoints" / "last.ckpt") == 2  # 2 of 8 batches: mid-epoch

    resumed = cli_process([*_run_args(tiny_digits, tmp_path, 3), "--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "unreliable results" not in resumed.stdout + resumed.stderr
    assert _iteration(tmp_path / "checkpoints" / "last.ckpt") == 3


def test_a_stop_on_nan_names_the_checkpoint_there_is(tiny_digits, tmp_path):
    """Item 10: "the last checkpoint on disk predates them" was said when there was none."""
    nan = {"class_path": "tests.helpers.NaNFromIteration", "init_args": {"start": 1}}
    args = quickstart_fit_args(
        tiny_digits,
        tmp_path,
        [saver(every_n_iterations=50)],
        *("--trainer.limit_train_batches", "4", "--model.init_args.reward_fn", json.dumps(nan)),
        *("--model.init_args.ppo.on_bad_reward", "drop", "--model.init_args.ppo.max_consecutive_skips", "2"),
        prompts=64,
    )
    with pytest.raises(
        FloatingPointError,
        match=r"in a row \(ppo.max_consecutive_skips = 2\): stopping\. "
        r"This run saved no checkpoint\.$",
    ):
        main(args)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("slow", ["reward model loading", "Trainer setting up"])
def test_ctrl_c_at_start_up_is_one_line_and_exit_130(slow, tiny_digits, tmp_path):
    """Item 10: Ctrl-C before training used to print a KeyboardInterrupt traceback (while models
    load) or Lightning's "attempting graceful shutdown" and exit status 1 (inside ``fit``)."""
    started = tmp_path / "started"
    if slow == "reward model loading":
        reward = {"class_path": "tests.helpers.SlowToLoadReward", "init_args": {"started_file": str(started)}}
        callbacks, extra = [saver()], ("--model.init_args.reward_fn", json.dumps(reward))
    else:
        callbacks = [
            saver(),
            {"class_path": "tests.helpers.SlowSetup", "init_args": {"started_file": str(started)}},
        ]
        extra = ()
    args = quickstart_fit_args(tiny_digits, tmp_path, callbacks, *extra, prompts=64)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lightning_ppo.console", *args]  # the console script's entry
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not started.exists() and process.poll() is None:
        assert time.monotonic() < deadline, "the slow start never began"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith("lightning-ppo:")] == [lines[-1]]
    assert (
        lines[-1]
        == "lightning-ppo: interrupted (Ctrl-C) before training started; nothing was trained or saved"
    )
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
