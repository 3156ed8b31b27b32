"""Handles a forked child must never destroy: the weights group's gloo process group and its stores
(:mod:`.weight_group`). Their destructors join or wait for threads that only the parent has, so a
child that dropped its copy (a DataLoader worker forked after a sync, collecting the garbage of a
failed one; a user's ``multiprocessing`` pool) hung for good or died of SIGSEGV.

Each handle is noted here as it is made (weakly: the parent frees it as usual). Just before a fork
the parent holds every noted handle still alive, so that the child's copy of that hold keeps them
alive there for good, whatever the child drops first (Python's own after-fork step frees the
child's copies of other threads, with whatever they alone held). The parent lets go of its hold
right after the fork, on a thread of its own: it may have been the last, and a stopped sync's
group waits in its destructor (:meth:`.weight_group.WeightsGroup.let_go`).

Stdlib only: vLLM's workers import this through :mod:`.weight_group`.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any, TypeVar

Handle = TypeVar("Handle")

_NOTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()
_AT_FORK: list[Any] = []  # held across a fork, in the parent only as long as the fork takes
_INHERITED: list[Any] = []  # in a forked child: the parent's handles, never destroyed here


def note(handle: Handle) -> Handle:
    """``handle``, noted: a child forked while it is alive never destroys it."""
    _NOTED[next(_NUMBERS)] = handle
    return handle


def inherited() -> int:
    """How many of its parents' handles this process holds for good (0 in a process never forked)."""
    return len(_INHERITED)


def _hold() -> None:
    _AT_FORK.extend(_NOTED.values())


def _let_go_in_parent() -> None:
    if _AT_FORK:
        held = list(_AT_FORK)
        _AT_FORK.clear()
        threading.Thread(target=held.clear, name="lightning-ppo-fork-let-go", daemon=True).start()


def _keep_in_child() -> None:
    # Those noted after the parent's hold (another thread's, during the hold) too, while alive.
    _INHERITED.extend([*_AT_FORK, *_NOTED.values()])
    _AT_FORK.clear()
    _NOTED.clear()


os.register_at_fork(before=_hold, after_in_parent=_let_go_in_parent, after_in_child=_keep_in_child)
