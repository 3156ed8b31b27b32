"""Gloo handles dropped on a thread of their own (a stopped sync's weights group,
:meth:`.weight_group.WeightsGroup.let_go`; a fork's hold of the groups, :mod:`.inherited`), and
the process's exit while such a thread runs.

A stopped sync leaves broadcasts pending in gloo's threads until the group's timeout (a peer that
neither reads nor closes: a frozen server), and the group's destructor waits for them with the GIL
released, so it must not run on the trainer's or a server worker's own thread. But a thread that
takes the GIL back once the interpreter has begun to finalize is ended by Python (3.11) with
``pthread_exit``, whose forced unwinding through that destructor (``noexcept``) is
``std::terminate``: a process that ended while the destructor ran (Ctrl-C during a sync to a frozen
server that died a moment later, a script ending just after a let-go) died of SIGABRT, "terminate
called without an active exception", instead of with its own error and exit status.

So a dropping thread destroys nothing while one of the group's operations is pending: it looks at
them every :data:`POLL_S` s (their own timeouts end them), and drops the handles once none is; the
destructor then takes milliseconds. As the process exits (``atexit``: before the interpreter
finalizes), a thread still waiting leaves what it holds alive for good (the process is ending: the
kernel closes the sockets) and one already destroying is joined, :data:`EXIT_BOUND_S` s at most in
all, so that the exit never waits out a group's timeout.

A weights receiving thread (:class:`.weight_group.Receiver`, a server worker's) waits in gloo with
the GIL released too, :data:`.weight_group.POLL_S` s a call: a server that ended while it waited
(rank 0 still to send) died of the same SIGABRT. It is joined at exit the same way (:func:`joined_at_exit`):
its waits end as :func:`exiting` says so.

Stdlib only: vLLM's workers import this through :mod:`.weight_group`.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from typing import Any

POLL_S = 0.05  # how often a dropping thread looks at the pending operations (one call each)
# The longest the exit waits, in all, for threads already destroying handles with nothing pending:
# that took ~20 ms (measured); a destructor still running after 5 s is hung in gloo, not slow.
EXIT_BOUND_S = 5.0

_THREADS: set[threading.Thread] = set()
_EXITING = threading.Event()
# Held while the flag is read and a thread registered, and while the flag is set and the threads
# listed: a let-go between the two would otherwise run unjoined as the interpreter finalizes.
# Reentrant: the garbage collector runs on whatever thread allocates, the exit's too while it holds
# this lock, and a group it collects is let go there (``WeightsGroup.__del__``), which takes it again.
_LOCK = threading.RLock()


def drop_later(held: list[Any], pending: list[Any], name: str) -> None:
    """Drop ``held`` (this process's last references to gloo handles, as the caller gave them up)
    on a thread named ``name``, once every work in ``pending`` has completed. ``pending`` is the
    caller's to give up: nothing is added to it once given here (a work added after this thread's
    look would be dropped while pending; ``WeightsGroup.lock`` sees to it)."""
    thread = threading.Thread(target=_drop, args=(held, pending), name=name, daemon=True)
    with _LOCK:
        dropping = not _EXITING.is_set()
        if dropping:
            _THREADS.add(thread)
    if dropping:
        try:
            thread.start()
            return
        except RuntimeError:  # no new thread at interpreter shutdown (a let-go from a finalizer)
            ended_thread(thread)
    _keep_for_good(held, pending)


def exiting() -> bool:
    """The process is ending (its ``atexit`` handlers run): a thread waiting in gloo stops waiting."""
    return _EXITING.is_set()


def joined_at_exit(thread: threading.Thread) -> None:
    """``thread``, which waits in gloo's calls (GIL released) and ends once :func:`exiting`, is joined
    as the process exits (within :data:`EXIT_BOUND_S` s in all) until it calls :func:`ended`."""
    with _LOCK:
        _THREADS.add(thread)


def ended() -> None:
    """The calling thread is done with gloo: the exit need not wait for it."""
    ended_thread(threading.current_thread())


def ended_thread(thread: threading.Thread) -> None:
    with _LOCK:
        _THREADS.discard(thread)


def _drop(held: list[Any], pending: list[Any]) -> None:
    """The exit is looked at first: a thread that started after the exit listed the threads to join
    (registered, not yet running) must not destroy anything as the interpreter finalizes."""
    try:
        while not _EXITING.is_set():
            if all(work.is_completed() for work in list(pending)):
                pending.clear()
                held.clear()
                return
            _EXITING.wait(POLL_S)
        _keep_for_good(held, pending)
    finally:
        ended()


def _keep_for_good(held: list[Any], pending: list[Any]) -> None:
    """Never destroyed, not even by the interpreter's finalization: its destructor would wait for
    the pending operations on the finalizing thread, up to the group's timeout."""
    for handle in [*held, *pending]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))  # never given back
    held.clear()
    pending.clear()


def _at_exit() -> None:
    with _LOCK:
        _EXITING.set()
        threads = list(_THREADS)
    deadline = time.monotonic() + EXIT_BOUND_S
    for thread in threads:
        if thread.ident is None:  # one not started yet finds the exit set and keeps its handles
            continue
        if thread is threading.current_thread():  # the exit's own (a send it ran, left registered)
            continue
        if isinstance(thread, threading._DummyThread):
            _said_ended(thread, deadline)
        else:
            thread.join(max(0.0, deadline - time.monotonic()))


def _said_ended(thread: threading.Thread, deadline: float) -> None:
    """Until ``thread``, one that ``threading`` did not start (a send on a Ray actor's or a C library's
    thread), called :func:`ended`: a dummy thread cannot be joined (its join raised in the exit's
    handler, and the threads after it went unjoined)."""
    while time.monotonic() < deadline:
        with _LOCK:
            if thread not in _THREADS:
                return
        time.sleep(POLL_S)


def _in_child() -> None:
    """A forked child has none of the parent's threads (what they held, :mod:`.inherited` keeps)."""
    global _EXITING, _LOCK
    _THREADS.clear()
    _EXITING = threading.Event()
    _LOCK = threading.RLock()  # another thread of the parent may have held it at the fork


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_in_child)
