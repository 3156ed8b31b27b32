"""What a run says and leaves behind in the cases where Lightning's own words or habits contradicted
the package (issue 19, items 6, 10 and 11): a moved run folder, warnings that do not apply, Ctrl-C
at start-up, field names without their section, row numbers, the prompt the reward sees."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule
from lightning_ppo.cli import main
from lightning_ppo.rewards import RewardFunction
from lightning_ppo.runs.ctrl_c import ctrl_c_exits
from tests.helpers import (
    cli_usage_error,
    forked_cli_process,
    one_line_error,
    quickstart_fit_args,
    quiet_trainer,
    saver,
    start_forked,
)

STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2


def _run_args(policy: Path, root: Path, iterations: int, *extra: str) -> list[str]:
    """The quickstart for ``iterations`` PPO iterations (a step limit: resumable), its checkpoints in
    ``root/checkpoints`` (the default folder), the best kept by score."""
    checkpoints = saver(every_n_iterations=1, monitor="objective/scores", mode="max", save_top_k=1)
    steps = ("--trainer.max_steps", str(iterations * STEPS_PER_ITERATION))
    return quickstart_fit_args(policy, root, [checkpoints], *steps, *extra, prompts=64)


def _iteration(path: Path) -> int:
    return torch.load(path, weights_only=True)["ppo_state"]["iteration"]


def test_a_moved_run_folder_resumes_into_its_own_last_ckpt(tiny_digits, tmp_path, capsys):
    """Item 6: Lightning forgets a checkpoint folder's files when its path changed and wrote
    ``last-v1.ckpt`` beside the moved ``last.ckpt``; a resumed run now overwrites its own. A run
    resumed from elsewhere into a folder holding another run's ``last.ckpt`` is refused, as a new
    run is, instead of mixing the two."""
    main(_run_args(tiny_digits, tmp_path / "first", 2))
    shutil.copytree(tmp_path / "first", tmp_path / "copy")
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    main([*_run_args(tiny_digits, moved, 3), "--ckpt_path", "last"])
    files = sorted(p.name for p in (moved / "checkpoints").glob("*.ckpt"))
    assert "last-v1.ckpt" not in files and len(files) == 2, files  # last.ckpt and one best (top-1)
    assert _iteration(moved / "checkpoints" / "last.ckpt") == 3

    copied = sorted((tmp_path / "copy" / "checkpoints").iterdir())
    elsewhere = str(moved / "checkpoints" / "last.ckpt")
    error = cli_usage_error(capsys, [*_run_args(tiny_digits, tmp_path / "copy", 4), "--ckpt_path", elsewhere])
    assert error.startswith(f"{os.path.realpath(tmp_path / 'copy' / 'checkpoints' / 'last.ckpt')} belongs to")
    assert sorted((tmp_path / "copy" / "checkpoints").iterdir()) == copied
    assert _iteration(tmp_path / "copy" / "checkpoints" / "last.ckpt") == 2  # untouched


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
    first = forked_cli_process(args)
    assert first.returncode == 0, first.stderr[-3000:]
    said = first.stdout + first.stderr
    nothing = (
        f"--ckpt_path last: no last.ckpt in {os.path.realpath(tmp_path / 'checkpoints')}: nothing to resume"
    )
    assert said.count(f"lightning_ppo: {nothing}; starting a new run") == 1
    assert "no last checkpoint available" not in said and "across ranks is zero" not in said
    assert _iteration(tmp_path / "checkpoints" / "last.ckpt") == 2  # 2 of 8 batches: mid-epoch

    resumed = forked_cli_process([*_run_args(tiny_digits, tmp_path, 3), "--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "unreliable results" not in resumed.stdout + resumed.stderr
    assert _iteration(tmp_path / "checkpoints" / "last.ckpt") == 3


def test_a_stop_on_nan_names_the_checkpoint_there_is(tiny_digits, tmp_path, capsys):
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
    # a deliberate stop: one line and exit status 2, no traceback (issue 43)
    message = cli_usage_error(capsys, args)
    assert re.search(
        r"in a row \(ppo.max_consecutive_skips = 2\): stopping\. This run saved no checkpoint\.$", message
    ), message
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
    # the console script's entry; Python's Ctrl-C handler in the child even where this test runs in
    # a background job (which starts with SIGINT ignored, and Python then leaves it ignored)
    process = start_forked(
        args,
        entry="lightning_ppo.console",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        interruptible=True,
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


@pytest.mark.parametrize(
    ("launched", "says_it"),
    [
        ({}, True),  # one process
        ({"LOCAL_RANK": "1"}, False),  # Lightning's launcher, one node: its child
        ({"NODE_RANK": "1"}, False),  # Lightning's launcher, node 1, before it launched
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, False),  # and after: node 1's first process
        ({"NODE_RANK": "0", "LOCAL_RANK": "0"}, True),
        ({"RANK": "1", "LOCAL_RANK": "0", "GROUP_RANK": "1"}, False),  # torchrun, node 1
        ({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, True),
        ({"SLURM_PROCID": "2", "SLURM_NODEID": "1"}, False),
    ],
)
def test_ctrl_c_line_comes_from_global_rank_zero_only(monkeypatch, capsys, launched, says_it):
    """Issue 22: on two nodes started by Lightning's launcher, node 1's process (LOCAL_RANK 0) wrote
    the Ctrl-C line too. Every rank exits with 130; one line in all."""
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info, ctrl_c_exits("lightning-ppo"):
        raise KeyboardInterrupt
    assert exit_info.value.code == 130
    line = "lightning-ppo: interrupted (Ctrl-C) before training started; nothing was trained or saved\n"
    assert capsys.readouterr().err == (line if says_it else "")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--data.init_args.val_size", "1.5"), "a fractional data.val_size must be below 1, got 1.5"),
        (("--model.init_args.value_model", "tied"), "model.value_model must be one of"),
        (("--model.init_args.frozen_dtype", "fp8"), "model.frozen_dtype must be one of"),
    ],
    ids=["data", "model-value_model", "model-frozen_dtype"],
)
def test_a_bad_value_is_named_with_its_section(args, expected, tiny_digits, tmp_path, capsys):
    """Item 11: ``batch_size must be at least 1`` said which ``batch_size``? Now ``data.batch_size``,
    ``model.value_model``, as the keys are written in the config."""
    line = cli_usage_error(capsys, quickstart_fit_args(tiny_digits, tmp_path, [], *args, prompts=64))
    assert line.startswith(expected), line


def test_a_bad_data_row_is_named_by_its_file_and_line(tiny_digits, tmp_path):
    """Item 11: "train row 1" counted from 0 over the concatenation of every file (and after the
    ``val_size`` shuffle); now the file and the line the row is on."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"prompt": f"{i}{i}="}) + "\n" for i in range(6)))
    second.write_text('{"prompt": "12="}\n\n{"prompt": null}\n')  # the bad row is on line 3
    data = {
        "class_path": "lightning_ppo.PromptDataModule",
        "init_args": {"data_files": [str(first), str(second)], "val_size": 2, "batch_size": 2},
    }
    done = forked_cli_process(quickstart_fit_args(tiny_digits, tmp_path, [], "--data", json.dumps(data)))
    assert one_line_error(done) == (
        f"{str(second)!r} line 3: data.prompt_column 'prompt' must hold strings or conversations (lists of "
        "{'role': ..., 'content': ...} messages), got NoneType (None)"
    )


class RecordPrompts(RewardFunction):
    """Scores 0; keeps the prompt texts it was given."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompts, completions, batch):
        self.prompts += prompts
        return [0.0] * len(completions)


def test_the_reward_gets_the_prompt_the_policy_saw(tiny_digits):
    """Item 11: a prompt longer than ``data.max_prompt_length`` is cut to its last tokens for the
    policy; the reward got the whole text. Now it gets the kept tokens' text, as the policy saw it."""
    reward = RecordPrompts()
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=reward,
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=2),
    )
    data = PromptDataModule(prompts=["1234567=", "89=", "9876543="], batch_size=3, max_prompt_length=4)
    quiet_trainer("unused", iterations=1).fit(module, datamodule=data)
    assert sorted(reward.prompts) == ["543=", "567=", "89="]
