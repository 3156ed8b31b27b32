"""The test zygote (``tests/zygote.py``): a test that kills a forked command on its timeout kills
what that command started too (Lightning's launcher starts rank 1 as a child of rank 0; a server is
a child of the run), so nothing outlives the test to hold a core, a port or a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ForkedProcess, spawn_forked, start_forked


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: absent or a zombie (killed, not reaped yet by whoever adopted it) is not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("session", [False, True], ids=["own-group", "new-session"])
def test_kill_reaches_what_the_command_started(tmp_path: Path, session: bool) -> None:
    pid_file = tmp_path / "grandchild.pid"
    process = start_forked([str(pid_file)], entry="tests.test_zygote", start_new_session=session)
    if not isinstance(process, ForkedProcess):
        pytest.skip("no zygote here (off Linux or LIGHTNING_PPO_TEST_NO_FORK): Popen's own kill applies")
    try:
        assert _wait_for(lambda: pid_file.is_file() and pid_file.read_text().endswith("\n"), 60)
        grandchild = int(pid_file.read_text())
        assert _alive(grandchild)
    finally:
        process.kill()
        process.wait(timeout=60)
    assert process.returncode == -9
    assert _wait_for(lambda: not _alive(grandchild), 30), "the command's own child outlived its kill"


def _start_a_child_and_wait(pid_file: str) -> None:
    """Run as the forked command: start a long child, say its pid, wait to be killed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_file).write_text(f"{child.pid}\n")
    child.wait(timeout=300)


def _parse_the_quickstart_config(rank: int, out: str) -> None:
    """Run as a forked command: parse configs/quickstart.yaml as ``fit`` does (``--print_config``
    stops after the parse), then write the modules that were imported meanwhile."""
    import contextlib
    import io

    from lightning_ppo.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    sys.argv[1:] = []  # tests.call's own arguments: not the command line LightningCLI is given
    before = set(sys.modules)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(["fit", "--config", str(config), "--print_config"])
    Path(out).write_text("\n".join(sorted(set(sys.modules) - before)))


def test_a_forked_command_parses_a_config_naming_wandb_without_importing_it_again(tmp_path: Path) -> None:
    """Parsing a config that names the WandbLogger imports wandb (jsonargparse runs Lightning's
    ``TYPE_CHECKING`` imports to resolve its hints): ~400 modules, 0.6 s of one core in each rank of
    each forked run, paid once in the zygote instead."""
    if os.environ.get("LIGHTNING_PPO_TEST_NO_FORK", "0") != "0" or sys.platform != "linux":
        pytest.skip("no zygote here (off Linux or LIGHTNING_PPO_TEST_NO_FORK): every command imports anew")
    out = tmp_path / "imported.txt"
    spawn_forked(_parse_the_quickstart_config, args=(str(out),), nprocs=1)
    imported = out.read_text().split()
    assert imported, "the parse imported nothing: it did not run"
    assert [name for name in imported if name.split(".")[0] == "wandb"] == []


def _forked_from(env: dict[str, str]) -> int:
    """The pid of the process a forked command with ``env`` was forked from: its zygote's."""
    process = start_forked(["--ppid"], entry="tests.test_zygote", env=env, stdout=subprocess.PIPE, text=True)
    if not isinstance(process, ForkedProcess):
        pytest.skip("no zygote here (off Linux or LIGHTNING_PPO_TEST_NO_FORK): every command starts anew")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    return int(out)


def test_wandb_s_mode_and_service_do_not_start_another_zygote() -> None:
    """Neither wandb 0.17.2 nor 0.31 reads WANDB_MODE or WANDB_SERVICE at import (WANDB_DIR, say,
    0.17.2 does): a command's own are read in it. Before, each value was a zygote of its own (~5 s of
    one core, ~0.5 GB): a test's WANDB_MODE=offline, and the WANDB_SERVICE an in-process wandb.init
    leaves in the test process's environment, which every later forked command then carried."""
    zygote = _forked_from({})
    assert _forked_from({"WANDB_MODE": "offline"}) == zygote
    assert _forked_from({"WANDB_SERVICE": "3-1-unix-/tmp/wandb-1-2-3"}) == zygote


if __name__ == "__main__":
    if sys.argv[1] == "--ppid":  # _forked_from's command; os._exit flushes nothing
        sys.stdout.write(f"{os.getppid()}\n")
        sys.stdout.flush()
    else:
        _start_a_child_and_wait(sys.argv[1])
    os._exit(0)
