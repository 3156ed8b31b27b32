"""The objects a ``vllm_server`` fit starts with, left out of the garbage collector's passes until
the fit ends.

Python's full collection walks every tracked object of the process: after torch, transformers and
Lightning are imported, about half a million, next to none of which dies during a fit. A batch of
a thousand requests to the servers holds some sixty tracked objects per request in flight
(aiohttp's requests, responses and coroutines) long enough to reach the oldest generation, so each
batch set off one full collection: about 0.25 s of the trainer's CPU, more than half of what it
spends sending and reading the batch (docs/servers.md, *Routing over several servers*).
``gc.freeze()`` moves the objects that exist at the fit's start to a generation the collector
never walks; ``gc.unfreeze()`` puts them back as the fit ends.

It is the whole process's setting, hence its scope: taken as a fit whose engine is ``vllm_server``
starts (after one full collection, so that no garbage is frozen), given back as that fit ends,
however it ends (several fits at once in one process: as the last of them ends), and never taken
where something else froze objects already (a user's own ``gc.freeze()``, before forking workers).
What it costs: an object of the fit's start that becomes cyclic garbage during the fit is freed
only as the fit ends, by a full collection then (objects freed by their reference count, most of
them, go at once as always); they are a bounded set, the process as the fit began; and two full
collections a fit, one at each end.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

from lightning.pytorch import Callback


class _Holds:
    """The fits holding the freeze in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def take(self) -> bool:
        """Freezes the process's objects for a fit (the first fit only), true where it did or another
        fit of ours had; false where something else froze objects already."""
        with self.lock:
            if self.count == 0:
                if gc.get_freeze_count():
                    return False
                gc.collect()
                gc.freeze()
            self.count += 1
            return True

    def give_back(self) -> None:
        """Thaws the objects as the last fit holding them ends, and collects what of them died
        meanwhile: here and now, not in a child forked later (whose collection would run their
        finalizers on locks the parent's threads held as it forked) nor at a random later batch."""
        with self.lock:
            self.count -= 1
            if self.count == 0:
                gc.unfreeze()
                gc.collect()


HOLDS = _Holds()


class FreezeStartupObjects(Callback):
    """Holds the freeze from the start of a ``vllm_server`` fit to its end (:data:`HOLDS`)."""

    def __init__(self) -> None:
        self.held = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = getattr(getattr(pl_module, "generation_config", None), "engine", None)
        if engine == "vllm_server" and not self.held:
            self.held = HOLDS.take()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._give_back()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._give_back()  # Lightning calls no teardown when fit raises

    def _give_back(self) -> None:
        if self.held:
            self.held = False
            HOLDS.give_back()
