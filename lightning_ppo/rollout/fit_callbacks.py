"""The callbacks every ``fit`` of the module runs with (its ``configure_callbacks``).

- :class:`~lightning_ppo.distributed.stop_children.StopChildrenOnFailure`: when rank 0 fails under
  Lightning's own launcher, the ranks it started are killed (Lightning does it only on Ctrl-C).
- :class:`~lightning_ppo.rollout.ahead.EndSamplingOnFailure`: a failed fit leaves no pipeline
  for the next one.
- :class:`CloseEngine`: the generation engine's connections to its servers (``vllm_server``:
  an event loop and pooled sessions, :mod:`.engines.server.connections`) are closed as the fit
  ends, however it ends; the engine opens them again at its next batch (a second ``fit``).
- :class:`~lightning_ppo.rollout.frozen_startup.FreezeStartupObjects`: a ``vllm_server`` fit's
  objects of its start are left out of the garbage collector's passes until it ends.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from lightning_ppo.distributed.stop_children import StopChildrenOnFailure
from lightning_ppo.rollout.ahead import EndSamplingOnFailure
from lightning_ppo.rollout.frozen_startup import FreezeStartupObjects


class CloseEngine(Callback):
    """Closes the module's engine where it has something to close (only the server engine has)."""

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _close(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls no teardown when fit raises; sampling ahead was ended before this
        # (the callbacks run in order), a job left running on the engine stops with its batch.
        _close(pl_module)


def _close(pl_module: Any) -> None:
    close = getattr(getattr(pl_module, "_engine", None), "close", None)
    if close is not None:
        close()


def fit_callbacks() -> list[Callback]:
    # The children are stopped first: a later callback's own error would skip it.
    return [StopChildrenOnFailure(), EndSamplingOnFailure(), CloseEngine(), FreezeStartupObjects()]
