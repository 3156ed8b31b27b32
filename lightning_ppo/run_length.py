"""How long a run trains, in the Trainer's units and in PPO iterations.

Under manual optimization Lightning's ``trainer.max_steps`` counts optimizer steps, and a PPO
iteration takes ``ppo.ppo_epochs x ppo.num_minibatches`` of them; Lightning checks the limit only
between iterations. A limit that is not a whole number of iterations would be overshot (``max_steps:
3`` with 2 steps per iteration stopped after 4), so it is refused; a valid one is translated into
iterations once at the start.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_ppo.config import PPOConfig
from lightning_ppo.errors import UsageError


def steps_per_iteration(ppo: PPOConfig) -> int:
    """Optimizer steps of one PPO iteration (gradient accumulation happens inside a step)."""
    return ppo.ppo_epochs * ppo.num_minibatches


def check_step_limit(max_steps: int | None, ppo: PPOConfig) -> str | None:
    """Refuse a ``trainer.max_steps`` that is not a whole number of PPO iterations; else say, in a
    sentence, what it means in iterations (None: no limit)."""
    if max_steps is None or max_steps < 0:  # Lightning's -1: no limit
        return None
    per = steps_per_iteration(ppo)
    why = f"ppo.ppo_epochs {ppo.ppo_epochs} x ppo.num_minibatches {ppo.num_minibatches}"
    if max_steps % per:
        below, above = max_steps // per * per, (max_steps // per + 1) * per
        raise UsageError(
            f"trainer.max_steps {max_steps} counts optimizer steps, {per} per PPO iteration ({why}), and "
            f"is checked between iterations: the run would stop after {above}; use a multiple of {per} "
            f"({', '.join(str(n) for n in (below, above) if n)}), or set the length in iterations with "
            "trainer.limit_train_batches and trainer.max_epochs"
        )
    return (
        f"trainer.max_steps {max_steps} = {max_steps // per} PPO iterations of {per} optimizer steps ({why})"
    )


def announce_step_limit(trainer: Trainer, ppo: PPOConfig, stage: str) -> None:
    """At the start of ``fit``: refuse a step limit that would be overshot, or say what it means."""
    if stage != "fit":
        return
    sentence = check_step_limit(trainer.max_steps, ppo)
    if sentence is not None:
        rank_zero_info(f"lightning_ppo: {sentence}")
