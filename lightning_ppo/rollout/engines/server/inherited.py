"""Handles a forked child must never destroy: the weights group's gloo process group and its stores
(:mod:`.weight_group`). Their destructors join or wait for threads that only the parent has, so a
child that dropped its copy (a DataLoader worker forked after a sync, collecting the garbage of a
failed one; a user's ``multiprocessing`` pool) hung for good or died of SIGSEGV.

Each handle is noted here as it is made (weakly: the parent frees it as usual). Just before a fork
the parent holds every noted handle still alive, so that the child inherits that hold whatever it
drops first (Python's own after-fork step frees the child's copies of other threads, with whatever
they alone held); the child then takes a reference to each that nothing ever gives back, so not
even its interpreter's exit destroys them (a child that returned normally hung at exit). The parent
lets go of its hold right after the fork, on a thread of its own (:mod:`.let_go`): it may have been
the last, and a stopped sync's group waits in its destructor (:meth:`.weight_group.WeightsGroup.let_go`).

Stdlib only: vLLM's workers import this through :mod:`.weight_group`.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import weakref
from typing import Any, TypeVar

from lightning_ppo.rollout.engines.server.let_go import drop_later

Handle = TypeVar("Handle")

_NOTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()
_AT_FORK: list[Any] = []  # held across a fork, in the parent only as long as the fork takes


def note(handle: Handle) -> Handle:
    """``handle``, noted: a child forked while it is alive never destroys it."""
    _NOTED[next(_NUMBERS)] = handle
    return handle


def _noted() -> list[Any]:
    """The noted handles still alive. The references are copied in one step: another thread may note
    one during a fork (a sync on the sampling-ahead thread, a worker's receiving thread), and
    iterating the mapping as it changed raised in the fork's hook, the hold left partial."""
    return [handle for ref in _NOTED.valuerefs() if (handle := ref()) is not None]


def _hold() -> None:
    _AT_FORK.extend(_noted())


def _let_go_in_parent() -> None:
    if _AT_FORK:
        held = list(_AT_FORK)
        _AT_FORK.clear()
        drop_later(held, [], "lightning-ppo-fork-let-go")


def _keep_in_child() -> None:
    # Those noted after the parent's hold (another thread's, during the hold) too, while alive.
    for handle in {id(h): h for h in [*_AT_FORK, *_noted()]}.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))  # never given back: never destroyed here
    _AT_FORK.clear()
    _NOTED.clear()


os.register_at_fork(before=_hold, after_in_parent=_let_go_in_parent, after_in_child=_keep_in_child)
