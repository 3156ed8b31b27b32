"""What the data-parallel ranks do together outside the FSDP2 plan, whatever the strategy (DDP or
FSDP2): reductions and decisions over the ranks, gradients accumulated without a sync, and
sampling generators that differ from rank to rank.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_ppo.distributed.sharding import is_sharded, no_gradient_sync
from lightning_ppo.ppo.functional import Reduce


def over_ranks(trainer: Trainer | None, op: str) -> Reduce | None:
    """A tensor's ``op`` (``"sum"``, ``"mean"``) over the ranks, by the strategy's all-reduce; ``None``
    in one process (or outside a Trainer)."""
    if trainer is None or trainer.world_size == 1:
        return None
    return lambda x: trainer.strategy.reduce(x.clone(), reduce_op=op)


def any_rank(trainer: Trainer | None) -> Callable[[bool], bool]:
    """Whether a flag is true on any rank (the strategy's all-reduce); the flag itself in one process
    (or outside a Trainer)."""
    if trainer is None:
        return bool
    return partial(trainer.strategy.reduce_boolean_decision, all=False)


def no_backward_sync(module: nn.Module, strategy: Any) -> AbstractContextManager:
    """Backward passes that accumulate gradients on each rank without syncing them: FSDP2's for a
    sharded module, else the strategy's (DDP's ``no_sync``), else nothing to hold back."""
    if is_sharded(module):
        return no_gradient_sync(module)
    block = getattr(strategy, "block_backward_sync", None)
    return block() if block is not None else nullcontext()


def seed_ranks_apart(trainer: Trainer) -> None:
    """``seed_everything`` gives every rank the same generator: offset it so ranks sample differently.
    A resumed run then overwrites this with each rank's saved state (``on_load_checkpoint``)."""
    if trainer.world_size > 1:
        torch.manual_seed(torch.initial_seed() + 1_000_003 * trainer.global_rank)
