"""Sharded (FSDP2) checkpoint folders survive kills and full disks, on 2 CPU ranks (gloo), and hold only
the trained weights."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_ppo.distributed.sharded_checkpoint import remove_stale_folders
from tests.helpers import quickstart_fit_args, ranks_process, saver, start_ranks, two_cpu_ranks

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 3
FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}


def _faulty(fault: str, rank: int = 0) -> dict:
    init = {"fault": fault, "fault_at": 2, "rank": rank}
    return {"class_path": "tests.helpers.FaultyShardedStrategy", "init_args": init}


def _args(policy: Path, root: Path, strategy: dict, *extra: str, callbacks: tuple = ()) -> list[str]:
    checkpoints = saver(every_n_iterations=1, dirpath=str(root / "ckpt"), save_top_k=0)
    return quickstart_fit_args(
        policy,
        root,
        [*callbacks, checkpoints],
        *two_cpu_ranks(strategy, ITERATIONS),
        *("--trainer.enable_checkpointing", "true", "--model.init_args.generation.max_new_tokens", "4"),
        *extra,
        prompts=64,
        config=ROOT / "configs" / "fsdp2.yaml",
    )


def _iteration(folder: Path) -> int:
    return torch.load(folder / "meta.pt", weights_only=True)["ppo_state"]["iteration"]


def _saved_keys(folder: Path) -> set[str]:
    """The names of the weights a sharded checkpoint holds, from its DCP metadata."""
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {key.removeprefix("state_dict.") for key in metadata if key.startswith("state_dict.")}


def _side_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmpdir-" in p.name or ".old-" in p.name)


# Two 2-rank fits (60 s in a loaded make test): a kill during a save is in make test unsharded
# (test_checkpoint_io), a sharded save that fails part way in the ENOSPC case below.
@pytest.mark.long
def test_kill_during_a_sharded_save_keeps_the_previous_last_ckpt_and_resumes(
    tiny_digits, tiny_reward, tmp_path
):
    reward_model = ("--model.init_args.reward_model", str(tiny_reward))  # a frozen role more to leave out
    # both ranks, started together and killed together
    process = start_ranks(
        _args(tiny_digits, tmp_path, _faulty("stall"), *reward_model),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    folder, last = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    temp = folder / f".last.ckpt.tmpdir-{socket.gethostname()}-{process.pid}"  # named by rank 0
    deadline = time.monotonic() + 120
    # the second save is under way (rank 0 stalls with half a shard written) once the first is complete
    while not (temp.is_dir() and any(temp.iterdir()) and (last / "meta.pt").is_file()):
        assert process.poll() is None and time.monotonic() < deadline, "the second save never started"
        time.sleep(0.1)
    process.kill()
    process.wait(timeout=30)

    assert _iteration(last) == 1  # the previous checkpoint, complete: its metadata and its shards
    saved = _saved_keys(last)
    assert any(key.startswith("roles.policy.") for key in saved)
    assert not [key for key in saved if key.startswith(("roles.ref_policy.", "reward_model."))]
    assert _side_folders(folder) == [temp.name]  # the killed write, hidden beside it

    done = ranks_process([*_args(tiny_digits, tmp_path, FSDP2, *reward_model), "--ckpt_path", "last"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert _iteration(last) == ITERATIONS
    assert _side_folders(folder) == []  # the dead run's folder was removed at start


# The real full disk (a small tmpfs, 55 s in a loaded make test) in make test-long; the same failure
# raised by rank 1's writer stays in make test.
@pytest.mark.parametrize(
    "disk", ["rank-1-writer-raises-ENOSPC", pytest.param("full-tmpfs", marks=pytest.mark.long)]
)
def test_full_disk_during_a_sharded_save_keeps_the_previous_last_ckpt_and_says_so(
    disk, tiny_digits, tmp_path, request
):

    if disk == "full-tmpfs":
        root = request.getfixturevalue("small_disk")
        fill = {"class_path": "tests.helpers.FillDisk", "init_args": {"folder": str(root), "at": 2}}
        args = _args(tiny_digits, root, FSDP2, callbacks=(fill,))
    else:
        root = tmp_path
        args = _args(tiny_digits, root, _faulty("ENOSPC", rank=1))
    done = ranks_process(args)
    last = root / "ckpt" / "last.ckpt"
    message = f"could not write checkpoint {last}: No space left on device; the previous last.ckpt is intact"
    assert done.returncode != 0
    # every rank says the same (rank 1 ran out of space, or both), and it is the last line
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if "could not write checkpoint" in line]
    said = all(line.endswith(f"OSError: [Errno 28] {message}") for line in errors)
    assert errors and said, done.stderr[-6000:]
    assert lines[-1] in errors
    assert _iteration(last) == 1
    assert _side_folders(root / "ckpt") == []  # the failed write removed


def test_only_dead_writers_folders_are_cleared_and_a_moved_aside_checkpoint_comes_back(tmp_path):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    host = socket.gethostname()
    dead, live, other_host = f"{host}-{finished.pid}", f"{host}-{os.getppid()}", f"elsewhere-{finished.pid}"
    names = {
        "dead write": f".last.ckpt.tmpdir-{dead}",
        "live write": f".last.ckpt.tmpdir-{live}",
        "other host": f".last.ckpt.tmpdir-{other_host}",
        "stranded": f".iteration=3.ckpt.old-{dead}",  # killed between publish's two renames
        "replaced": f".last.ckpt.old-{dead}",  # killed after both, before the old one was removed
        "last": "last.ckpt",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.pt").write_bytes(name.encode())
    (tmp_path / f".last.ckpt.tmp-{finished.pid}").write_bytes(b"a single-file save's: not a folder")
    cleared = remove_stale_folders(tmp_path)
    assert sorted(cleared) == sorted(tmp_path / names[k] for k in ("dead write", "stranded", "replaced"))
    left = {p.name for p in tmp_path.iterdir()}
    kept = {names[k] for k in ("live write", "other host", "last")}
    assert left == kept | {"iteration=3.ckpt", f".last.ckpt.tmp-{finished.pid}"}
    assert (tmp_path / "iteration=3.ckpt" / "meta.pt").read_bytes() == names["stranded"].encode()
    assert (tmp_path / "last.ckpt" / "meta.pt").read_bytes() == b"last.ckpt"
    shutil.rmtree(tmp_path / names["live write"])
