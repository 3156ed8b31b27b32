"""Rank 0 failing under Lightning's own launcher takes the ranks it started with it
(lightning_ppo.distributed.stop_children): 2 CPU ranks, the real CLI, rank 1 started by Lightning."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_ppo.tasks.digits import DigitsReward
from tests.helpers import quickstart_fit_args, start_forked, two_cpu_ranks

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)


class FailsOnRankZero(DigitsReward):
    """Rank 0 raises at its 2nd call, once rank 1 is busy in its own 2nd call: a sleep outside any
    collective (a slow reward service), which no dead peer interrupts. Rank 0 then exits slowly."""

    def __init__(self, pid_file: str) -> None:
        super().__init__()
        self.pid_file, self.calls = Path(pid_file), 0

    def __call__(self, prompts, completions, batch):
        self.calls += 1
        if self.calls == 2 and dist.get_rank() == 0:
            deadline = time.monotonic() + 120
            while not self.pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            atexit.register(time.sleep, 8)  # a slow exit, as a W&B run finishing its upload
            raise RuntimeError("the reward service answered 500 on rank 0")
        if self.calls == 2:
            self.pid_file.write_text(str(os.getpid()))
            time.sleep(300)
        return super().__call__(prompts, completions, batch)


def test_rank_zero_failing_stops_the_rank_it_started(tiny_digits, tmp_path):
    pid_file = tmp_path / "rank1.pid"
    failing = "tests.test_stop_children.FailsOnRankZero"
    reward = {"class_path": failing, "init_args": {"pid_file": str(pid_file)}}
    args = quickstart_fit_args(tiny_digits, tmp_path, [], *two_cpu_ranks("ddp", iterations=3))
    args += ["--model.init_args.reward_fn", json.dumps(reward)]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    log = tmp_path / "output.txt"
    child = None
    try:
        returncode, output = _run(args, env, log)
        # 1, the error's: not -9, rank 0 killed by Lightning's process observer during its slow exit
        # for the child it had itself killed (a review of the first version of this fix)
        assert returncode == 1, output[-3000:]
        assert "the reward service answered 500 on rank 0" in output, output[-3000:]
        child = int(pid_file.read_text())
        # 60 s: far from both behaviours (gone within a second; before, it slept its 300 s out).
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), f"rank 1 (pid {child}) outlived rank 0\n{output[-3000:]}"
        assert "rank 0 ended with RuntimeError: stopped the 1 other rank(s) it started" in output
    finally:
        if child is None and pid_file.exists():
            child = int(pid_file.read_text())
        if child is not None and _alive(child) and b"lightning_ppo" in _cmdline(child):
            os.kill(child, signal.SIGKILL)


def test_a_stop_every_rank_takes_keeps_the_ranks_for_a_checkpoint_saved_on_it(tiny_digits, tmp_path):
    """Lightning's ``ModelCheckpoint(save_on_exception=True)`` saves in its on_exception, after this
    package's callbacks (Lightning orders checkpoint callbacks last), and the save is a collective
    every rank takes part in. Rank 1 killed first, rank 0's save failed on the dead peer
    (gloo: 'Connection reset by peer', in place of the stop's own line) and nothing was saved."""
    saved = tmp_path / "on_exception"
    saver = {"dirpath": str(saved), "save_on_exception": True, "every_n_train_steps": 1000}
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": saver}]
    args = quickstart_fit_args(tiny_digits, tmp_path, callbacks, *two_cpu_ranks("ddp", iterations=4))
    # every rank's reward NaN together from its 3rd call: a stop on purpose that every rank takes at
    # the same iteration (RunStopped), each going on into on_exception by itself
    nan = {"class_path": "tests.helpers.NaNFromIteration", "init_args": {"start": 2}}
    args += ["--model.init_args.reward_fn", json.dumps(nan)]
    args += ["--model.init_args.ppo.on_bad_reward", "drop"]
    args += ["--model.init_args.ppo.max_consecutive_skips", "1"]
    args += ["--trainer.enable_checkpointing", "true"]
    env = {"OMP_NUM_THREADS": "1"}
    log = tmp_path / "output.txt"
    try:
        returncode, output = _run(args, env, log)
        # 2: the stop's own one line (a UsageError); 1 before, gloo's error on the dead peer
        assert returncode == 2, output[-3000:]
        assert "lightning-ppo: error: the reward 'NaNFromIteration' returned only NaN" in output
        assert "Connection reset by peer" not in output, output[-3000:]
        assert [path.suffix for path in saved.iterdir()] == [".ckpt"], output[-3000:]
    finally:
        _kill_our_ranks(tmp_path)


def _run(args: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
    """``lightning_ppo.cli ARGS`` to its end (bounded): its return code and its output. Output to a
    file, not a pipe: rank 1 inherits it, and a pipe would stay open while rank 1 lives. Rank 0 is
    forked from the test zygote (its imports done, as in every test of this worker), a user's
    ``python -m lightning_ppo.cli``; Lightning's launcher in it starts rank 1 as a new interpreter."""
    with log.open("w") as out:
        main = start_forked(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = main.wait(timeout=300)
        except subprocess.TimeoutExpired:
            main.kill()
            main.wait(timeout=60)
            raise
    return returncode, log.read_text()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _kill_our_ranks(root: Path) -> None:
    """Whatever is left of a run that did not end as the test wanted (rank 0 is ended by
    :func:`_run`): the rank it started, found by its command line (Lightning re-runs rank 0's, which
    names ``root``)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _alive(int(proc.name)):
            cmdline = _cmdline(int(proc.name))
            if b"lightning_ppo" in cmdline and str(root).encode() in cmdline:
                os.kill(int(proc.name), signal.SIGKILL)
