"""The selfcheck's learning rate: decayed per iteration, so the plateau is quiet.

At a constant rate the policy keeps moving around the optimum by what each noisy batch pushes it:
measured, 0.025-0.032 nats of ``KL(pi || pi*)`` on average over the plateau at AdamW's 3e-3 (gae,
rloo). Decayed linearly to a tenth by the last iteration: 0.004-0.015, 0.025 with a shared critic
(benchmarks/selfcheck_calibration.py), which is what lets the verdict's allowance be small. Per
iteration (the Trainer's batches), not per optimizer step, so ``ppo.ppo_epochs`` or
``ppo.num_minibatches`` given on the command line leave the schedule as it is.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer


class IterationDecay(Callback):
    """Each param group's learning rate times ``1 - (1 - end_factor) x i / (iterations - 1)`` at
    iteration ``i``: the configured rate at the first, ``end_factor`` of it at the last.

    Args:
        end_factor: The share of the configured rate left at the last iteration.
    """

    def __init__(self, end_factor: float = 0.1) -> None:
        self.end_factor = end_factor
        self.base: list[float] | None = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        groups = trainer.optimizers[0].param_groups
        if self.base is None:
            self.base = [group["lr"] for group in groups]
        done = batch_idx / max(trainer.num_training_batches - 1, 1)
        for group, base in zip(groups, self.base, strict=True):
            group["lr"] = base * (1 - (1 - self.end_factor) * done)
