"""The learning-rate scheduler the PPO update steps: once after every optimizer step (``ppo_update``).

A scheduler that steps on a monitored metric (``ReduceLROnPlateau``) cannot be stepped so: its
``step()`` takes the metric, and the update has none at each optimizer step. Under manual
optimization Lightning steps no scheduler itself (its ``monitor`` key would be ignored), so such a
scheduler failed with torch's ``TypeError`` (``missing 1 required positional argument: 'metrics'``)
after the first rollout and update; it is refused in one line when the optimizer is built.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_ppo.config import UsageError


def check_scheduler(scheduler: Any, field: str = "model.lr_scheduler") -> None:
    """One line naming ``field`` if ``scheduler`` cannot be stepped once per optimizer step."""
    if isinstance(scheduler, ReduceLROnPlateau):
        raise UsageError(
            f"{field}: ReduceLROnPlateau steps on a monitored metric, and the PPO update steps its "
            "scheduler after every optimizer step, with no metric: use a schedule by step (LambdaLR, "
            "LinearLR, CosineAnnealingLR, OneCycleLR, ...)"
        )
