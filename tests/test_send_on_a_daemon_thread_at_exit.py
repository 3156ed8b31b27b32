"""A script that ends, or raises, while a daemon thread of it broadcasts weights (a user's fit run
on a daemon thread; the package's own sampling ahead syncs on the training thread) to a peer that
takes nothing more (a frozen server): the sending thread took the GIL back from gloo's wait as the
interpreter finalized, exit status 134 (SIGABRT), "terminate called without an active exception"
(3 of 3 runs before, both ways). Each case runs in a new interpreter; the group on 127.0.0.1."""

from __future__ import annotations

import sys

import pytest

from tests.test_let_go_at_exit import _script

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo on 127.0.0.1, Linux's exit")

# Rank 1 takes the first bucket's header, then nothing (its 64 MB tensor stays pending on rank 0).
_SENDING_ON_A_DAEMON_THREAD = """
import sys, threading, time
import torch
from lightning_ppo.rollout.engines.server.weight_group import _broadcast, send
from tests.test_weight_group_fork import _pair
zero, one = _pair()

def frozen():
    length = _broadcast(one, torch.zeros(1, dtype=torch.int64), lambda: None)
    _broadcast(one, torch.empty(int(length), dtype=torch.uint8), lambda: None)

threading.Thread(target=frozen, daemon=True).start()
weights = iter([("a", torch.ones(16 * 2**20)), ("b", torch.ones(1))])
threading.Thread(target=send, args=(zero, weights, "run/1", lambda: None, 2**20), daemon=True).start()
time.sleep(1.0)  # the 64 MB broadcast is pending
if sys.argv[1:] == ["raises"]:
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize(("how", "status"), [("ends", 0), ("raises", 1)])
def test_a_script_that_ends_while_a_daemon_thread_sends_ends_with_its_own_status(tmp_path, how, status):
    done = _script(tmp_path, _SENDING_ON_A_DAEMON_THREAD, how)
    assert "terminate called" not in done.stderr
    assert done.returncode == status, done.stderr[-2000:]
    if how == "raises":  # the thread's send then raises SyncStopped ("this process is exiting")
        assert "RuntimeError: the script failed" in done.stderr.splitlines()


# The same send on a thread that ``threading`` did not start (a Ray actor's, a C library's callback
# thread: Python knows it as a dummy thread, which cannot be joined).
_SENDING_ON_A_FOREIGN_THREAD = _SENDING_ON_A_DAEMON_THREAD.replace(
    'threading.Thread(target=send, args=(zero, weights, "run/1", lambda: None, 2**20), daemon=True).start()',
    'import _thread\n_thread.start_new_thread(send, (zero, weights, "run/1", lambda: None, 2**20))',
)


def test_a_script_that_ends_while_a_thread_not_started_by_threading_sends_ends_with_status_0(tmp_path):
    """The exit joins a sending thread; one that ``threading`` did not start is a dummy thread there,
    whose join raised in the exit's handler ("AssertionError: cannot join a dummy thread" on stderr,
    2 runs of 2), leaving it and every thread listed after it unjoined (the joins that keep a thread
    from taking the GIL back from gloo as the interpreter finalizes: SIGABRT). The exit now waits
    for it to say it ended."""
    assert _SENDING_ON_A_FOREIGN_THREAD != _SENDING_ON_A_DAEMON_THREAD
    done = _script(tmp_path, _SENDING_ON_A_FOREIGN_THREAD, "ends")
    assert "terminate called" not in done.stderr
    assert "cannot join" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]


# The main thread left registered by a send (a Ctrl-C just after its registration, before its
# ``try``, put it there for good), beside a daemon thread's send pending to the frozen peer.
_MAIN_THREAD_LEFT_REGISTERED = _SENDING_ON_A_DAEMON_THREAD.replace(
    "zero, one = _pair()",
    "zero, one = _pair()\nfrom lightning_ppo.rollout.engines.server import let_go\n"
    "let_go.joined_at_exit(threading.current_thread())",
)


def test_a_script_whose_main_thread_a_send_left_registered_ends_with_status_0(tmp_path):
    """The exit's handler runs on the main thread and joined every registered thread: the main
    thread's own join raised ("RuntimeError: cannot join current thread" from the atexit callback),
    and the threads after it in the set went unjoined (the joins that keep a sending thread from
    taking the GIL back as the interpreter finalizes). The exit passes over its own thread now,
    and ``send`` registers its thread inside its ``try``."""
    done = _script(tmp_path, _MAIN_THREAD_LEFT_REGISTERED, "ends")
    assert "cannot join current thread" not in done.stderr, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
