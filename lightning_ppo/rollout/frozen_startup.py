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

Where Lightning skips the fit's hooks (another callback's ``on_exception`` raised before ours ran),
the freeze it held is given back as the next fit starts or another ends: a fit whose trainer no
longer runs it holds nothing. (Where a Ctrl-C lands between ``gc.freeze()`` and the holder's note,
a window of a few bytecodes, the freeze stays: no fit of the process takes it again.) A
``gc.freeze()`` of someone else's during the fit (more frozen at its end than the fit froze) is
left as it is: theirs covers the fit's objects, and thawing would undo it.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerStatus


class _Holds:
    """The fits holding the freeze in this process (their callbacks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders: list[FreezeStartupObjects] = []
        self.frozen = 0  # gc.get_freeze_count() as the freeze was taken

    def take(self, holder: FreezeStartupObjects) -> bool:
        """Freezes the process's objects for ``holder``'s fit (the first fit only), true where it did
        or another running fit of ours had; false where something else froze objects already."""
        with self.lock:
            self._drop(None)
            if not self.holders:
                if gc.get_freeze_count():
                    return False
                gc.collect()
                gc.freeze()
                self.frozen = gc.get_freeze_count()
            self.holders.append(holder)
            return True

    def give_back(self, holder: FreezeStartupObjects) -> None:
        """Thaws the objects as the last fit holding them ends, and collects what of them died
        meanwhile: here and now, not in a child forked later (whose collection would run their
        finalizers on locks the parent's threads held as it forked) nor at a random later batch."""
        with self.lock:
            if holder in self.holders:
                self._drop(holder)

    def _drop(self, holder: FreezeStartupObjects | None) -> None:
        """Drops ``holder`` and the fits that ended without giving the freeze back (Lightning
        skipped their hooks), thawing the objects where none is left."""
        held = bool(self.holders)
        self.holders = [other for other in self.holders if other is not holder and other.fit_runs()]
        if held and not self.holders:
            self._thaw()

    def _thaw(self) -> None:
        # Frozen objects only leave the frozen generation as they die: more of them than the freeze
        # took means another gc.freeze() since, which covers ours.
        if gc.get_freeze_count() > self.frozen:
            return
        gc.unfreeze()
        gc.collect()


HOLDS = _Holds()


class FreezeStartupObjects(Callback):
    """Holds the freeze from the start of a ``vllm_server`` fit to its end (:data:`HOLDS`)."""

    def __init__(self) -> None:
        self.held = False
        self.trainer: weakref.ref[Any] | None = None

    def fit_runs(self) -> bool:
        """Whether the fit this callback holds the freeze for still runs: its trainer runs a fit
        with this callback (a later fit of the same trainer has a callback of its own)."""
        trainer = self.trainer() if self.trainer is not None else None
        return (
            trainer is not None
            and trainer.state.status == TrainerStatus.RUNNING
            and any(callback is self for callback in trainer.callbacks)
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = getattr(getattr(pl_module, "generation_config", None), "engine", None)
        if engine == "vllm_server" and not self.held:
            self.trainer = weakref.ref(trainer)
            self.held = HOLDS.take(self)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._give_back()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._give_back()  # Lightning calls no teardown when fit raises

    def _give_back(self) -> None:
        if self.held:
            self.held = False
            HOLDS.give_back(self)
