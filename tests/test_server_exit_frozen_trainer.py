"""A server's process SIGTERM'd (as ``vllm serve``'s workers are stopped, SIGTERM raising SystemExit)
while its worker receives the weights of a trainer that is frozen (stopped, its machine gone from
the network): nothing it asks of rank 0's store is ever answered, not even within the store's
timeout (torch's ``TCPStore`` client has none for a peer that neither answers nor closes). The
worker extension runs as it does in a server (its load on the process's main thread, vLLM's
``WorkerProc``), around a tiny torch model; rank 0 is a process of its own, so that it can be
frozen (SIGSTOP); both on 127.0.0.1, each in a new interpreter."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import communicate

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo on 127.0.0.1, SIGSTOP")
ROOT = Path(__file__).resolve().parents[1]
GROUP_TIMEOUT_S = 120  # the group's (and the stores'): the server must end far within it
SECRET = "frozen-trainer"

# Rank 0: the first two buckets (one tensor each), then it gathers nothing more for a minute.
_RANK_ZERO = f"""
import time
import torch
from lightning_ppo.rollout.engines.server.weight_group import listening_socket, open_group, send
listener = listening_socket("127.0.0.1")
print(listener.getsockname()[1], flush=True)
zero = open_group("127.0.0.1", listener.getsockname()[1], 0, 2, {GROUP_TIMEOUT_S}, "127.0.0.1",
                  {SECRET!r}, listener=listener)

def weights():
    yield "0.weight", torch.full((32, 32), 2.0)
    yield "0.bias", torch.full((32,), 2.0)
    yield "1.weight", torch.full((32, 32), 2.0)
    time.sleep(60)

send(zero, weights(), "run/1", bucket_bytes=4096)
"""

# The server: a worker of the real extension; each tensor loaded is said on stdout.
_SERVER = f"""
import signal, sys
from types import SimpleNamespace
import torch
from lightning_ppo.rollout.engines.server import worker_extension

def stop(signum, frame):  # as vLLM's WorkerProc
    raise SystemExit()

signal.signal(signal.SIGTERM, stop)
worker_extension._repack_embedding_gemms = lambda model: None

class Worker(worker_extension.WeightSyncExtension):
    def __init__(self, model):
        self.model_runner, self.rank = SimpleNamespace(get_model=lambda: model), 0

    def reload_weights(self, weights_iterator):
        held = dict(self.model_runner.get_model().named_parameters())
        with torch.no_grad():
            for name, tensor in weights_iterator:
                held[name].copy_(tensor)
                print(name, flush=True)

worker = Worker(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
worker.lppo_join("127.0.0.1", sys.argv[1], "2", "1", "{GROUP_TIMEOUT_S}", "127.0.0.1", {SECRET!r})
worker.lppo_receive("0", "run/1", {SECRET!r})
"""


def _start(tmp_path: Path, name: str, code: str, *args: str) -> subprocess.Popen:
    (tmp_path / name).write_text(textwrap.dedent(code))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, str(tmp_path / name), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(process: subprocess.Popen) -> queue.Queue[str]:
    """``process``'s stdout, a line at a time, read on a thread (so that every wait is bounded)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return lines


def _until(lines: queue.Queue[str], wanted: str, process: subprocess.Popen, within: float = 60.0) -> str:
    """The lines up to ``wanted``, read within ``within`` seconds in all."""
    seen = []
    with contextlib.suppress(queue.Empty):
        while (line := lines.get(timeout=within)) != wanted:
            seen.append(line)
        return line
    raise AssertionError(f"no {wanted!r} within {within} s: {seen}; {process.args} ended {process.poll()}")


def _freeze(pid: int, within: float = 10.0) -> None:
    """SIGSTOP ``pid``, returning once every thread of it is stopped (a thread of its store that
    answered one call more would let the call that hangs go)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        states = [
            (task / "stat").read_text().rpartition(")")[2].split()[0]
            for task in Path(f"/proc/{pid}/task").iterdir()
        ]
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"rank 0's threads not all stopped within {within} s: {states}")


@pytest.mark.long  # ~18 s: two interpreters, and the exit joins threads left in store calls (5 s)
def test_a_server_sigtermed_while_receiving_from_a_frozen_trainer_ends_with_status_0(tmp_path):
    """Before: the worker's load, stopped by SystemExit, said so in rank 0's store (to stop the
    sync for every member), a call that never returned: the server still ran 90 s after its
    SIGTERM (killed; 3 of 3 runs). Now it ends with SystemExit's status, 0, in ~8 s."""
    rank_zero = _start(tmp_path, "rank_zero.py", _RANK_ZERO)
    server = None
    try:
        port = _lines(rank_zero).get(timeout=60)  # its store is served
        server = _start(tmp_path, "server.py", _SERVER, port)
        _until(_lines(server), "0.bias", server)  # the second bucket is loaded: the third awaited
        _freeze(rank_zero.pid)
        server.send_signal(signal.SIGTERM)
        _, stderr = communicate(server, GROUP_TIMEOUT_S / 4)
    finally:
        for process in (server, rank_zero):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)
    assert "terminate called" not in stderr
    assert server.returncode == 0, stderr[-2000:]
