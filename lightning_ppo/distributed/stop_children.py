"""When rank 0 fails, the ranks it started go with it.

Under Lightning's own launcher (``trainer.devices: 2`` on one machine, DDP or FSDP2), rank 0 is the
process that started the other ranks. A child that fails is seen by Lightning's process observer,
which kills every rank; but when rank 0 itself raises, Lightning kills its children only for
Ctrl-C (``_call_and_handle_interrupt``). For any other error rank 0 exits and leaves them behind:
under NCCL a pending all-reduce does not notice the dead peer and waits out the process group's
timeout (30 minutes by default) holding its GPU, and a child busy outside a collective (a slow
reward, a hung environment) outlives rank 0 on any backend. :class:`StopChildrenOnFailure` kills
them as Lightning does on Ctrl-C. Under torchrun or SLURM the ranks are started outside (the
launcher's ``procs`` is empty): nothing to do there, their launcher ends the run.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal

log = logging.getLogger(__name__)


class StopChildrenOnFailure(Callback):
    """Kills the ranks this process started when its fit raises (only the rank that launched the
    others, rank 0 on its node, has any)."""

    def __init__(self) -> None:
        self.deferred: list[Callback] = []  # the callbacks whose on_exception stops the children
        self.ended_with = ""  # the exception's class, for the line that says why the ranks stopped

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        # Ctrl-C: Lightning kills the children itself, and lightning_ppo.runs.ctrl_c says it in one line.
        if isinstance(exception, KeyboardInterrupt) or not isinstance(launcher, _SubprocessScriptLauncher):
            return
        self.ended_with = type(exception).__name__
        callbacks = list(trainer.callbacks)
        later = callbacks[callbacks.index(self) + 1 :] if self in callbacks else []
        if any(getattr(callback, "save_on_exception", False) for callback in later):
            # Lightning's ModelCheckpoint(save_on_exception=True) saves after this (checkpoint
            # callbacks run last) in a collective every rank takes part in (a stop they all take:
            # RunStopped, SIGTERM): its children killed first, rank 0's save failed on the dead
            # peers. Stopped after the last callback, or as soon as one of them raises.
            self.deferred = later
            for callback in later:
                callback.on_exception = self._then_stop(callback, callback is later[-1])
            return
        self.stop(trainer)

    def _then_stop(self, callback: Callback, last: bool) -> Any:
        hook = callback.on_exception

        def on_exception(trainer: Any, pl_module: Any, exception: BaseException) -> None:
            try:
                hook(trainer, pl_module, exception)
            except BaseException:
                self.stop(trainer)
                raise
            if last:
                self.stop(trainer)

        return on_exception

    def stop(self, trainer: Any) -> None:
        """Kill the children still running (the launcher's ``procs``)."""
        for callback in self.deferred:  # the hooks of the class again, for a later exception
            callback.__dict__.pop("on_exception", None)
        self.deferred = []
        launcher = trainer.strategy.launcher
        alive = [proc for proc in launcher.procs if proc.poll() is None]
        if not alive:
            return  # started by torchrun or SLURM (no procs), or already gone
        # Lightning's process observer watches this very list and, seeing a child killed, kills this
        # process too within its 5 s period: mid-teardown, before its error is printed or a W&B run
        # is finished. Emptied first, the observer ends quietly at its next look.
        launcher.procs.clear()
        # SIGKILL (SIGTERM on Windows), as Lightning on Ctrl-C: a SIGTERM would not reach a child
        # blocked inside a C call (a collective, a socket read). Killed before anything is said, so
        # that nothing can skip it.
        for proc in alive:
            proc.send_signal(_get_sigkill_signal())
        # A warning, so that it is printed: it says why the other ranks end without an error of their own.
        rank, others = trainer.global_rank, len(alive)
        why = f"rank {rank} ended with {self.ended_with}"
        log.warning(f"lightning_ppo: {why}: stopped the {others} other rank(s) it started")
