"""Checkpoint files survive kills and full disks, and an unwritable output folder stops a run at its start."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.cli import main
from lightning_ppo.runs.checkpoint_io import AtomicCheckpointIO, remove_stale_temp_files
from lightning_ppo.runs.processes import host_name
from lightning_ppo.runs.writable import UnwritableFolderError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import (
    DiskFullCheckpointIO,
    FillDisk,
    cli_usage_error,
    quickstart_fit_args,
    quiet_trainer,
    saver,
    start_forked,
)

ITERATIONS = 4


def _cli_args(policy: Path, root: Path, *extra: str, ckpt: Path | None = None) -> list[str]:
    folder = root / "ckpt" if ckpt is None else ckpt
    callback = saver(every_n_iterations=1, dirpath=str(folder), save_top_k=0)
    limit = ("--trainer.limit_train_batches", str(ITERATIONS))
    return quickstart_fit_args(policy, root, [callback], *limit, *extra, prompts=64)


def _iteration(path: Path) -> int:
    return torch.load(path, weights_only=True)["ppo_state"]["iteration"]


def _temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def test_kill_during_a_save_keeps_the_previous_last_ckpt_and_resumes(tiny_digits, tmp_path):
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    stall = {"class_path": "tests.helpers.StallingCheckpointIO", "init_args": {"fault_at": 3}}
    args = _cli_args(tiny_digits, tmp_path, "--trainer.plugins", json.dumps([stall]))
    process = start_forked(
        args, env={"TMPDIR": str(system_tmp)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    last, temp = (
        tmp_path / "ckpt" / "last.ckpt",
        tmp_path / "ckpt" / f".last.ckpt.tmp-{host_name()}-{process.pid}",
    )
    deadline = time.monotonic() + 60
    # the third save is under way (and stalls half-written) once the second one is complete. Checked
    # in this order: a temporary file seen before last.ckpt read as iteration 2 may be the second
    # save's, renamed in between (seen once under load: the kill then found no temporary file).
    while not (last.exists() and _iteration(last) == 2 and temp.exists()) and process.poll() is None:
        assert time.monotonic() < deadline, "the third save never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)

    assert _iteration(last) == 2  # the previous one, complete
    assert _temp_files(tmp_path / "ckpt") == [temp.name]  # the killed write, hidden beside it
    # nothing went to the temp dir (where wandb's import leaves empty folders)
    assert [p for p in system_tmp.rglob("*") if not p.is_dir()] == []

    resumed = main([*_cli_args(tiny_digits, tmp_path), "--ckpt_path", "last"])
    assert resumed.model.iteration == ITERATIONS
    assert _iteration(last) == ITERATIONS
    assert _temp_files(tmp_path / "ckpt") == []  # the dead run's temp file was removed at start


def _module(policy: Path) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=4),
    )


def _data() -> DigitsDataModule:
    return DigitsDataModule(num_prompts=64, num_digits=3, batch_size=8, max_prompt_length=8)


@pytest.mark.parametrize("disk", ["writer-raises-ENOSPC", "full-tmpfs"])
def test_full_disk_keeps_the_previous_last_ckpt_and_says_so(disk, tiny_digits, tmp_path, request):
    if disk == "full-tmpfs":
        folder = request.getfixturevalue("small_disk") / "ckpt"
        callbacks, plugins = [FillDisk(str(folder.parent), at=2)], []
    else:
        folder = tmp_path / "ckpt"
        callbacks, plugins = [], [DiskFullCheckpointIO(fault_at=2)]
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=folder, save_top_k=0)
    trainer = quiet_trainer(tmp_path, ITERATIONS, [*callbacks, saver], plugins)
    message = f"could not write checkpoint {folder / 'last.ckpt'}: No space left on device; "
    with pytest.raises(OSError, match=re.escape(message + "the previous last.ckpt is intact")) as failure:
        trainer.fit(_module(tiny_digits), datamodule=_data())
    assert failure.value.errno == errno.ENOSPC
    assert _iteration(folder / "last.ckpt") == 1
    assert _temp_files(folder) == []


def test_interrupted_save_removes_its_temp_file_and_keeps_the_old_file(tmp_path):

    class Interrupted(AtomicCheckpointIO):
        def write(self, checkpoint, file):
            file.write(b"half a checkpoint")
            raise KeyboardInterrupt

    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"iteration": 1}, target)
    with pytest.raises(KeyboardInterrupt):
        Interrupted().save_checkpoint({"iteration": 2}, target)
    assert torch.load(target, weights_only=True) == {"iteration": 1}
    assert _temp_files(tmp_path) == []


def test_only_dead_writers_temp_files_are_removed(tmp_path):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead, live = (
        f".last.ckpt.tmp-{host_name()}-{finished.pid}",
        f".last.ckpt.tmp-{host_name()}-{os.getppid()}",
    )
    # Another host's writer on a shared disk: its pid is not a process here, yet it may be saving now.
    elsewhere = f".last.ckpt.tmp-another-host.example-{finished.pid}"
    legacy = f".last.ckpt.tmp-{finished.pid}"  # an older version's name, without the host: never judged
    others = ["last.ckpt", "notes.tmp-1", f"{dead}.bak", elsewhere, legacy]
    for name in [dead, live, *others]:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == [tmp_path / dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, *others])


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["umask-022", "umask-002"])
def test_checkpoints_and_exported_files_get_the_mode_open_gives_under_the_umask(umask, tmp_path):
    """0o666 & ~umask (0644, 0664) for every file make-tiny, fit and export write: safetensors alone
    would leave the weights 0600, unreadable to the other users or containers that serve them."""
    previous = os.umask(umask)
    try:
        main(["make-tiny", "--out", str(tmp_path / "tiny"), "--alphabet", "0123456789="])
        main(_cli_args(tmp_path / "tiny", tmp_path, "--trainer.limit_train_batches", "1"))
        main(["export", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(tmp_path / "exported")])
    finally:
        os.umask(previous)
    folders = ("tiny", "ckpt", "exported")
    modes = {
        f"{folder}/{path.name}": oct(path.stat().st_mode & 0o777)
        for folder in folders
        for path in (tmp_path / folder).iterdir()
    }
    assert {"tiny/model.safetensors", "ckpt/last.ckpt", "exported/model.safetensors"} <= modes.keys()
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


FIELDS = [
    "trainer.callbacks[0].init_args.dirpath",
    "trainer.logger[0].init_args.save_dir",
    "trainer.default_root_dir",
]


@pytest.mark.parametrize("field", FIELDS)
def test_unwritable_output_folder_fails_before_any_model_loads(field, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("a regular file: nothing can be created under it, not even by root")
    folder = blocker / "out"
    missing = tmp_path / "no-such-model"  # loading it would fail, differently
    args = _cli_args(missing, tmp_path)
    if field.startswith("trainer.callbacks"):
        args = _cli_args(missing, tmp_path, ckpt=folder)
    elif field.startswith("trainer.logger"):
        csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(folder)}}
        args += ["--trainer.logger", json.dumps([csv])]
    else:
        args += ["--trainer.default_root_dir", str(folder)]
    assert cli_usage_error(capsys, args).startswith(f"{field}: cannot write to {folder}")


def test_unwritable_dirpath_fails_at_setup_before_training(tiny_digits, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    module = _module(tiny_digits)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=blocker / "ckpt")
    message = f"PPOCheckpoint.dirpath: cannot write to {blocker / 'ckpt'}: Not a directory"
    with pytest.raises(UnwritableFolderError, match=re.escape(message)):
        quiet_trainer(tmp_path, ITERATIONS, [saver]).fit(module, datamodule=_data())
    assert module.iteration == 0


def test_two_runs_started_at_once_in_one_folder_one_refuses_in_one_line(tiny_digits, tmp_path):
    """Both used to find no last.ckpt, train to the end and mix their checkpoints in one folder."""
    import subprocess

    from tests.helpers import quickstart_fit_args

    throttle = {"class_path": "tests.helpers.Throttle", "init_args": {"seconds": 0.5}}
    saver = {"class_path": "lightning_ppo.checkpoint.PPOCheckpoint", "init_args": {"every_n_iterations": 1}}
    args = quickstart_fit_args(
        tiny_digits, tmp_path / "run", [throttle, saver], "--trainer.limit_train_batches", "8"
    )
    runs = [start_forked(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [run.communicate(timeout=300)[1] for run in runs]
    results = [(run.returncode, err) for run, err in zip(runs, errors, strict=True)]
    assert sorted(code for code, _ in results) == [0, 2]
    (refused,) = [err for code, err in results if code == 2]
    last = [line for line in refused.strip().splitlines() if line.strip()][-1]
    assert "Traceback" not in refused
    assert "is in use by another run" in last, last  # started together: the lock, not last.ckpt, refused it
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "last-v1.ckpt" not in names and ".lightning_ppo.lock" not in names  # one run's files, unlocked


def test_a_stale_lock_of_this_host_is_taken_over_and_another_hosts_is_not(tmp_path):
    import subprocess
    import sys

    from lightning_ppo.runs.run_lock import LOCK_NAME, RunLock

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / LOCK_NAME).write_text(f"{host_name()} {int(dead.stdout)}\n")  # a killed run's
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and lock.held
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # a run of this host that is still going
        (tmp_path / LOCK_NAME).write_text(f"{host_name()} {alive.pid}\n")
        assert RunLock(tmp_path).acquire() == f"{host_name()} {alive.pid}"
    finally:
        alive.kill()
        alive.wait()
    (tmp_path / LOCK_NAME).unlink()
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).write_text("another-host 12345\n")  # its pid means nothing here
    assert RunLock(tmp_path).acquire() == "another-host 12345"
