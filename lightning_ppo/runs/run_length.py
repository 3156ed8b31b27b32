"""How long a run trains, in the Trainer's units and in PPO iterations.

Under manual optimization Lightning's ``trainer.max_steps`` counts optimizer steps, and a PPO
iteration takes ``ppo.ppo_epochs x ppo.num_minibatches`` of them; Lightning checks the limit only
between iterations. A limit that is not a whole number of iterations would be overshot (``max_steps:
3`` with 2 steps per iteration stopped after 4), so it is refused; a valid one is translated into
iterations once at the start.

A resumed run that has nothing left to do (its limits were reached when the checkpoint was written)
trains 0 iterations; :func:`explain_idle_resume` says which limit, and what would go on. With
``data.drop_last: false`` the epoch's short last batch must split into the minibatches too.
"""

from __future__ import annotations

import math

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities import rank_zero_info

from lightning_ppo.config import PPOConfig
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn


def steps_per_iteration(ppo: PPOConfig) -> int:
    """Optimizer steps of one PPO iteration (gradient accumulation happens inside a step)."""
    return ppo.ppo_epochs * ppo.num_minibatches


def check_step_limit(max_steps: int | None, ppo: PPOConfig, done: int = 0) -> str | None:
    """Refuse a ``trainer.max_steps`` that is not a whole number of PPO iterations past the ``done``
    steps a resumed run starts from; else say, in a sentence, what it means in iterations (None: no
    limit, or nothing left)."""
    if max_steps is None or max_steps < 0 or max_steps <= done:  # Lightning's -1: no limit
        return None
    per, left = steps_per_iteration(ppo), max_steps - done
    why = f"ppo.ppo_epochs {ppo.ppo_epochs} x ppo.num_minibatches {ppo.num_minibatches}"
    if left % per:
        below, above = done + left // per * per, done + (left // per + 1) * per
        fits = f"{done} (the checkpoint's steps) plus a multiple of {per}" if done else f"a multiple of {per}"
        raise UsageError(
            f"trainer.max_steps {max_steps} counts optimizer steps, {per} per PPO iteration ({why}), and "
            f"is checked between iterations: the run would stop after {above}; use {fits} "
            f"({', '.join(str(n) for n in (below, above) if n > done)}), or set the length in iterations "
            "with trainer.limit_train_batches and trainer.max_epochs"
        )
    iterations = f"{left // per} PPO iteration{'s' if left // per > 1 else ''} of {per} optimizer steps"
    resumed = f"the checkpoint's {done} steps + " if done else ""
    return f"trainer.max_steps {max_steps} = {resumed}{iterations} ({why})"


def check_last_batch(trainer: Trainer, ppo: PPOConfig) -> None:
    """With ``data.drop_last: false``, refuse a last batch of the epoch that the training loop will
    reach and that does not split into the minibatches (it used to fail at the end of the epoch).

    The sizes are a ``PromptDataModule``'s: its train set once set up, and a ``DistributedSampler``
    that gives every rank ``ceil(size / ranks)`` prompts.
    """
    data = trainer.datamodule
    dataset = getattr(data, "train_dataset", None)
    if getattr(data, "drop_last", True) or dataset is None or not isinstance(data.batch_size, int):
        return
    per_rank = math.ceil(len(dataset) / trainer.world_size)
    last, batches = per_rank % data.batch_size, math.ceil(per_rank / data.batch_size)
    if last == 0 or trainer.num_training_batches < batches:  # limit_train_batches stops before it
        return
    parts = ppo.num_minibatches * ppo.gradient_accumulation_steps
    if last * ppo.num_generations % parts == 0:
        return
    ranks = f" over {trainer.world_size} ranks ({per_rank} each)" if trainer.world_size > 1 else ""
    sequences = f" x ppo.num_generations {ppo.num_generations}" if ppo.num_generations > 1 else ""
    raise UsageError(
        f"data.drop_last is false and the train set's {len(dataset)} prompts{ranks} in batches of "
        f"data.batch_size {data.batch_size} leave a last batch of {last}{sequences}, which does not divide "
        f"into ppo.num_minibatches x ppo.gradient_accumulation_steps = {ppo.num_minibatches} x "
        f"{ppo.gradient_accumulation_steps} = {parts} equal parts: set data.drop_last: true, or another "
        "data.batch_size"
    )


def check_training_plan(trainer: Trainer, ppo: PPOConfig) -> None:
    """As training starts (a resumed run's loop restored, so ``global_step`` is the checkpoint's):
    refuse a step limit that would be overshot or a last batch that cannot be split, and say what
    the step limit means."""
    check_last_batch(trainer, ppo)
    sentence = check_step_limit(trainer.max_steps, ppo, trainer.global_step)
    if sentence is not None:
        rank_zero_info(f"lightning_ppo: {sentence}")


def explain_idle_resume(trainer: Trainer, resumed_at: int | None, iteration: int) -> None:
    """After ``fit``: warn when a run resumed at iteration ``resumed_at`` trained no iteration, naming
    the limit it had already reached."""
    if resumed_at is None or iteration != resumed_at or trainer.ckpt_path is None:
        return
    fit_loop = trainer.fit_loop
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer) and cb.time_remaining() is not None]
    if 0 <= fit_loop.max_steps <= trainer.global_step:
        why = (
            f"trainer.max_steps {fit_loop.max_steps} was reached already ({trainer.global_step} optimizer "
            "steps in the checkpoint): give a larger one"
        )
    elif 0 <= fit_loop.max_epochs <= trainer.current_epoch:
        why = (
            f"the checkpoint's run had finished {trainer.current_epoch} of trainer.max_epochs "
            f"{fit_loop.max_epochs} epochs (an epoch cut short by trainer.limit_train_batches counts as "
            "finished: a larger limit_train_batches does not reopen it): raise trainer.max_epochs to "
            "train more"
        )
    elif any(timer.time_remaining() <= 0 for timer in timers):
        why = "trainer.max_time was used up already (it counts the whole run, across resumes): give more"
    else:
        why = "the Trainer's loop had nothing left to do"
    warn(f"nothing trained: resumed from {trainer.ckpt_path} at iteration {iteration}, {why}")
