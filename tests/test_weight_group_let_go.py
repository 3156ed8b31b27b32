"""A weights group let go (``WeightsGroup.let_go``, ``lightning_ppo/rollout/engines/server/let_go.py``)
while another thread starts a broadcast on it: a server worker's loading thread lets go as its
receiving thread starts the next tensor's broadcast. Two ranks in this process, on 127.0.0.1."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_ppo.rollout.engines.server import weight_group
from lightning_ppo.rollout.engines.server.weight_group import SyncStopped, _broadcast, _start_broadcast
from tests.test_weight_group_fork import _pair

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo on 127.0.0.1")

ROOT = Path(__file__).resolve().parents[1]
LET_GO_THREAD = "lightning-ppo-weights-let-go"
# Far past what a socket buffers: rank 0's broadcast stays pending until rank 1 takes it.
LARGE = 64 * 2**20


def _let_go_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == LET_GO_THREAD]


def _ended(threads: list[threading.Thread], within: float) -> bool:
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def test_a_broadcast_started_as_the_group_is_let_go_is_waited_for(monkeypatch):
    """The let-go runs between the broadcast's start and its noting in the group's pending works
    (forced: it runs as the work is noted). Before, its thread took its look at the pending works
    first, found none and let go of the process group while the broadcast was pending (its
    destructor then waited for it, up to the group's timeout, and as the process exited). Now the
    let-go waits for the broadcast to be noted, and its thread for the broadcast to end."""
    zero, one = _pair()
    process_group = zero.process_group  # held here: the let-go's thread ends where it dropped it
    before = set(_let_go_threads())
    noted = weight_group.note
    started: list[object] = []

    def let_go_as_it_is_noted(handle):
        noted(handle)
        if not started:
            started.append(handle)
            letting = threading.Thread(target=zero.let_go)
            letting.start()
            letting.join(1.0)  # now: blocked until the broadcast is noted
            if not letting.is_alive():  # before: its thread's first look, bounded
                _ended([t for t in _let_go_threads() if t not in before], 10.0)
            started.append(letting)
        return handle

    monkeypatch.setattr(weight_group, "note", let_go_as_it_is_noted)
    sending = threading.Thread(target=_start_broadcast, args=(zero, torch.ones(LARGE, dtype=torch.uint8)))
    sending.start()
    sending.join(30)
    work, letting = started
    letting.join(30)
    assert not work.is_completed()  # rank 1 has taken nothing yet
    dropping = [t for t in _let_go_threads() if t not in before]
    assert len(dropping) == 1 and dropping[0].is_alive()  # waits for the broadcast
    with pytest.raises(SyncStopped, match="this member let go"):
        _start_broadcast(zero, torch.ones(1))  # none starts after the let-go
    received = _broadcast(one, torch.zeros(LARGE, dtype=torch.uint8), lambda: None)
    assert int(received.sum()) == LARGE
    assert _ended(dropping, 10.0)  # the broadcast ended: the let-go's thread drops the group
    one.let_go()
    del process_group


def test_a_group_nobody_let_go_of_is_dropped_on_a_thread_of_its_own_when_collected():
    """A group with a broadcast pending that nobody let go of (an engine dropped with its group, a
    test's leftover) held in a reference cycle: the garbage collector destroyed it on whatever thread
    allocated as it ran (a receiving thread starting its next broadcast, in CI: 30 s stuck there),
    and its destructor waited there for the broadcast, up to the group's timeout (8 s of 8 measured,
    ``gc.collect()`` on the main thread). Now it is let go as it is collected: the let-go's thread
    waits for the broadcast, and the collection returns at once."""
    zero, one = _pair()
    before = set(_let_go_threads())
    _start_broadcast(zero, torch.ones(LARGE, dtype=torch.uint8))
    zero.cycle = zero  # held by a cycle alone once this frame drops it
    del zero
    gc.collect()
    dropping = [t for t in _let_go_threads() if t not in before]
    assert len(dropping) == 1 and dropping[0].is_alive()  # waits for the broadcast
    received = _broadcast(one, torch.zeros(LARGE, dtype=torch.uint8), lambda: None)
    assert int(received.sum()) == LARGE
    assert _ended(dropping, 10.0)
    one.let_go()


# A group nobody let go of, held by a cycle, collected on a thread that holds the let-go's lock.
_COLLECTED_UNDER_A_LOCK = """
import gc
from lightning_ppo.rollout.engines.server import let_go
from tests.test_weight_group_fork import _pair
zero, one = _pair()
zero.cycle = zero
del zero
with let_go._LOCK:
    gc.collect()
print("collected")
one.let_go()
"""


def test_a_group_collected_on_a_thread_holding_the_let_gos_lock_is_let_go(tmp_path):
    """The garbage collector runs on whatever thread allocates, the exit's too as it lists the let-go
    threads to join (``let_go._LOCK`` held: ``Event.set`` and ``list`` allocate): a group nobody let
    go of, collected there, is let go in place (``WeightsGroup.__del__``), and the let-go registers
    its thread under that lock: the exit waited for itself for good. (threading's own lock, held as
    ``threading.enumerate()`` allocates, is reentrant.)"""
    script = tmp_path / "script.py"
    script.write_text(_COLLECTED_UNDER_A_LOCK)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(60)
        pytest.fail("the collection under the let-go's lock never returned")
    assert (process.returncode, stdout) == (0, "collected\n"), stderr[-2000:]
