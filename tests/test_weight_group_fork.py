"""The in-memory weights group (``lightning_ppo/rollout/engines/server/weight_group.py``) in a forked
child: a DataLoader worker, a user's ``multiprocessing`` pool, a test that forks, all after a sync.
The child's copy of the group (gloo's process group and the store) belongs to threads only the
parent has: destroying it there hung (rank 0's process group) or crashed the child (SIGSEGV, the
fault CI saw when tests/test_server_engine_review.py's forked child collected the groups that
tests/test_server_failures.py's tests left in reference cycles). Two ranks in this process, on
127.0.0.1; every child's wait is bounded and a child still running then is killed."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_ppo.rollout.engines.server.weight_group import (
    SyncStopped,
    WeightsGroup,
    listening_socket,
    open_group,
    receive,
    send,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork")


def _pair() -> tuple[WeightsGroup, WeightsGroup]:
    """Rank 0 and rank 1 of one group of two, both in this process."""
    listener = listening_socket("127.0.0.1")
    port, joined = listener.getsockname()[1], []
    peer = threading.Thread(
        target=lambda: joined.append(open_group("127.0.0.1", port, 1, 2, 30, "127.0.0.1"))
    )
    peer.start()
    zero = open_group("127.0.0.1", port, 0, 2, 30, "127.0.0.1", listener=listener)
    peer.join(30)
    return zero, joined[0]


def _synced(zero: WeightsGroup, one: WeightsGroup, version: str, value: float) -> list[tuple[str, list]]:
    """What rank 1 receives of rank 0's two weights filled with ``value``, sent as ``version``."""
    weights = [("a", torch.full((3,), value)), ("b", torch.full((2, 2), -value))]
    receiver = receive(one, version)
    sender = threading.Thread(target=send, args=(zero, iter(weights), version), daemon=True)
    sender.start()
    received = [(name, tensor.flatten().tolist()) for name, tensor in receiver]
    sender.join(30)
    return received


def _exit_code(child: int, within: float = 20.0) -> int | None:
    """The child's exit code (negative: the signal that ended it), None if it still ran after
    ``within`` seconds (then it is killed)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return None


def _expected(value: float) -> list[tuple[str, list]]:
    return [("a", [value] * 3), ("b", [-value] * 4)]


def test_a_forked_child_that_drops_the_parents_group_ends_and_the_parent_syncs_on():
    """The child drops both ranks' groups and collects them (as a child does with the garbage of
    its parent's earlier syncs): it hung or died of SIGSEGV; it exits 0 now, and the parent's group,
    untouched, carries the next sync whole."""
    zero, one = _pair()
    try:
        assert _synced(zero, one, "run/1", 2.0) == _expected(2.0)
        child = os.fork()
        if child == 0:  # pragma: no cover (its exit code says how it went)
            try:
                zero = one = None  # noqa: F841 (the child's only references to the parent's group)
                gc.collect()
            finally:
                os._exit(0)
        assert _exit_code(child) == 0
        assert _synced(zero, one, "run/2", 3.0) == _expected(3.0)
    finally:
        zero.let_go()
        one.let_go()


def test_a_forked_child_that_drops_a_handle_held_outside_its_group_ends():
    """A process group held outside its :class:`WeightsGroup` (a frame of a failed sync that a
    traceback keeps, a group being let go on its thread), dropped in the child, hung it."""
    zero, one = _pair()
    held = [zero.process_group]  # as a frame of a failed sync holds it
    try:
        assert _synced(zero, one, "run/1", 2.0) == _expected(2.0)
        zero.let_go()
        child = os.fork()
        if child == 0:  # pragma: no cover (its exit code says how it went)
            try:
                held.clear()
                gc.collect()
            finally:
                os._exit(0)
        assert _exit_code(child) == 0
    finally:
        held.clear()
        one.let_go()


def test_a_forked_child_that_syncs_on_the_parents_group_is_told_at_once():
    """The child's copy of the group has no gloo threads behind it: a sync on it waited for good
    (and its store calls went out on the parent's socket). It raises at once now, in one line."""
    zero, one = _pair()
    try:
        assert _synced(zero, one, "run/1", 2.0) == _expected(2.0)
        child = os.fork()
        if child == 0:  # pragma: no cover (its exit code says how it went)
            status = 1
            try:
                send(zero, iter([("a", torch.ones(3))]), "run/2")
            except SyncStopped as err:
                status = 0 if err.why == "this member let go of the weights group" else 2
            finally:
                os._exit(status)
        assert _exit_code(child) == 0
        assert _synced(zero, one, "run/2", 3.0) == _expected(3.0)
    finally:
        zero.let_go()
        one.let_go()


def _failing_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """Two weights, then the trainer's own error (its gather failed): the first is on the wire."""
    yield "a", torch.ones(3)
    yield "b", torch.ones(3)
    raise RuntimeError("the gather failed")


def test_a_forked_child_that_drops_a_failed_syncs_traceback_ends():
    """A sync that failed part way, its group let go and destroyed: the error's traceback (a
    notebook keeps the last one) still holds the broadcasts it had started, and each holds gloo's
    pairs. The child that dropped the error hung in gloo's destructor, waiting for a thread only
    the parent has (seen in a run of tests/test_server_engine_review.py)."""
    zero, one = _pair()
    raised: list[BaseException] = []

    def sending() -> None:
        try:
            send(zero, _failing_weights(), "run/1", bucket_bytes=1)
        except RuntimeError as err:
            raised.append(err)

    sender = threading.Thread(target=sending, daemon=True)
    receiver = receive(one, "run/1")
    sender.start()
    with pytest.raises(SyncStopped, match="the gather failed"):
        list(receiver)
    sender.join(30)
    assert [str(err) for err in raised] == ["the gather failed"]
    destroyed = weakref.ref(zero.process_group)
    zero.let_go()
    one.let_go()
    deadline = time.monotonic() + 30
    while destroyed() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert destroyed() is None  # only the traceback's broadcasts hold gloo's pairs now
    child = os.fork()
    if child == 0:  # pragma: no cover (its exit code says how it went)
        try:
            raised.clear()
            gc.collect()
        finally:
            os._exit(0)
    assert _exit_code(child) == 0


_CHILD_EXITS_NORMALLY = """
import os, sys
from tests.test_weight_group_fork import _exit_code, _expected, _pair, _synced
zero, one = _pair()
assert _synced(zero, one, "run/1", 2.0) == _expected(2.0)
child = os.fork()
if child == 0:
    sys.exit(0)  # the interpreter's own exit: it clears the modules, and whatever they held
code = _exit_code(child)
print("child", code, flush=True)
os._exit(0)
"""


def _child_ends_with_0(script: str) -> None:
    """``script`` (which forks a child and prints its exit code) run in a new interpreter: the child
    ended, with status 0, and so did the script."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["child", "0"]


def test_a_forked_child_that_exits_as_a_script_does_ends():
    """A child that returns from its work and exits as a script does (a user's ``os.fork()``, not
    multiprocessing's ``os._exit``): its interpreter's exit dropped the parent's group and hung."""
    _child_ends_with_0(_CHILD_EXITS_NORMALLY)


class _Handle:
    """A stand-in for a gloo handle: what :func:`.inherited.note` keeps needs only be weakly referable."""


def test_a_fork_while_another_thread_notes_handles_holds_them_all(monkeypatch):
    """A fork (a DataLoader worker starting) while another thread notes handles (a sync on the
    sampling-ahead thread, a worker's receiving thread): the parent's hold iterated the noted
    handles as they changed and raised 'dictionary changed size during iteration' in the fork's
    hook (a traceback on stderr, the hold partial): 19 forks of 20 here, with a thread noting
    (Python's thread switch made frequent, and many handles alive, to meet the window each time)."""
    from lightning_ppo.rollout.engines.server.inherited import note

    raised: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: raised.append(unraisable.exc_value))
    alive = [note(_Handle()) for _ in range(20_000)]
    stop = threading.Event()

    def noting() -> None:
        while not stop.is_set():
            note(_Handle())  # noted, then gone at once

    thread = threading.Thread(target=noting, daemon=True)
    switch = sys.getswitchinterval()
    thread.start()
    sys.setswitchinterval(1e-6)
    try:
        codes = []
        for _ in range(20):
            child = os.fork()
            if child == 0:
                os._exit(0)
            codes.append(_exit_code(child))
    finally:
        sys.setswitchinterval(switch)
        stop.set()
        thread.join(10)
    assert codes == [0] * 20
    assert [repr(error) for error in raised] == []
    assert len(alive) == 20_000


# The collector is held off until the child's fork hooks run (enabled by the first of them, before
# the package's own), and another thread of the parent holds the let-go's lock as it forks.
_COLLECTED_IN_THE_CHILDS_FORK_HOOKS = """
import gc, os, threading, time
gc.disable()
os.register_at_fork(after_in_child=gc.enable)
from lightning_ppo.rollout.engines.server import let_go
from tests.test_weight_group_fork import _exit_code, _pair
zero, one = _pair()
zero.cycle = zero
del zero
gc.set_threshold(1)
held = threading.Event()

def registering():  # for a second: the parent's own fork hook waits for the lock too
    with let_go._LOCK:
        held.set()
        time.sleep(1.0)

threading.Thread(target=registering, daemon=True).start()
held.wait(10)
child = os.fork()
if child == 0:
    os._exit(0)
print("child", _exit_code(child), flush=True)
one.let_go()
"""


def test_a_group_collected_in_a_forked_childs_fork_hooks_is_not_let_go_there():
    """The collector runs on whatever allocates, in a forked child too before the package's fork
    hooks have set the parent's groups aside (``threading``'s own, the let-go's ``_in_child``): a
    group of the parent left in a reference cycle was let go there (``WeightsGroup.__del__``), with
    the parent's lock copies (one held by another thread of the parent at the fork: the child hung
    for good), and a thread started in the child to wait for the parent's broadcasts. A child's copy
    is the parent's (:mod:`.inherited` keeps its handles): it lets go of nothing."""
    _child_ends_with_0(_COLLECTED_IN_THE_CHILDS_FORK_HOOKS)
