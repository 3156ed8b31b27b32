"""A batch scored by every configured reward at once, as TRL's reward functions expect to be run.

The module's rewards (the ``reward_fn`` list, functions and reward models alike, then
``reward_model`` and ``reward_adapter``) are summed with ``reward_weights``. On top of that sum:

- A reward may return ``None`` for a completion it does not apply to: that reward is left out of
  that completion's sum (it adds 0; the weights are not renormalised, as in TRL's ``nansum``). A
  completion that no reward scores is left out of the update and of its group's baseline (its
  score is NaN and dropped, whatever ``ppo.on_bad_reward`` says), counted in ``reward/unscored``
  and warned about once.
- A reward that returns an awaitable (an ``async def`` function) is awaited; several run
  concurrently (``asyncio.gather``) on one event loop that lives in a thread of its own for the
  whole process, so an async client a reward keeps between calls stays on its loop, and a run
  started from inside a running loop (a notebook) works too; each within ``ppo.reward_timeout``
  (``lightning_ppo.runs.bounded_calls``, which environments' calls share).
- ``log_metric(name, value)`` and ``log_extra(column, values)``: see :class:`ScoreInputs`. A reward
  that gives ``log_extra("correct", values)`` (1.0 right, 0.0 wrong, per completion) is what
  validation reports as ``eval/accuracy`` (greedy pass@1 on the held-out prompts).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections import defaultdict
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_ppo.rewards import ACCURACY_COLUMN, ScoreInputs, TrainerState, check_scores
from lightning_ppo.runs.bounded_calls import await_bounded, call_exited
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn


def answer_accuracy(correct: list[Any], batch_size: int) -> float:
    """The share of right answers in a reward's ``correct`` column (numbers: 1 right, 0 wrong)."""
    try:
        return sum(float(value) for value in correct) / batch_size
    except (TypeError, ValueError):
        raise UsageError(
            f"a reward's log_extra column {ACCURACY_COLUMN!r} holds {correct[:3]!r}...: it is read as "
            "eval/accuracy, so it must hold numbers (1.0 right, 0.0 wrong); name another column"
        ) from None


class Scorer:
    """Scores batches for a ``PPOLightningModule`` and keeps what the latest call produced: the rows
    no reward scored (for :meth:`check_total`) and the columns rewards gave ``log_extra``."""

    def __init__(self) -> None:
        self.unscored: Tensor | None = None
        self.columns: dict[str, list[Any]] = {}
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._warned = False
        self._seen_unscored = False  # from the first unscored row on, reward/unscored is logged every time

    def score(self, module: Any, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor:
        """(B,) weighted sum of ``module``'s rewards; NaN where no reward scored a completion."""
        n = len(completions)
        self.columns, self._metrics = {}, defaultdict(list)
        batch = replace(
            batch,
            trainer_state=trainer_state(module),
            log_metric=self._log_metric,
            log_extra=partial(self._log_extra, n),
        )
        components = reward_components(module)
        names = [name for name, _ in components]
        outputs = call_all([compute for _, compute in components], prompts, completions, batch, names)
        outputs = await_all(outputs, module.ppo.reward_timeout, names, n, module.ppo.on_bad_reward == "drop")
        total = torch.zeros(n, device=module.device)
        scored = torch.zeros(n, dtype=torch.bool, device=module.device)
        allow_nonfinite = module.ppo.on_bad_reward == "drop"
        prefix = log_prefix(module)
        for (name, _), output, weight in zip(components, outputs, module.reward_weights, strict=True):
            values, applies = split_none(output)
            part = check_scores(values, n, name, module.device, allow_nonfinite)
            applies = torch.ones_like(scored) if applies is None else applies.to(scored.device)
            if len(components) > 1 and prefix is not None:
                shown = part[applies & torch.isfinite(part)]
                module.log(f"{prefix}/{name}", shown.mean(), batch_size=n)
            total = total + weight * torch.where(applies, part, torch.zeros_like(part))
            scored |= applies
        if not components:
            scored[:] = True  # nothing configured (an environment's turn rewards only): 0 for all
        self.unscored = ~scored
        self._report(module, prefix, n)
        return total.masked_fill(self.unscored, float("nan"))

    def check_total(
        self, scores: Any, batch_size: int, name: str, device: torch.device, allow_nonfinite: bool
    ) -> Tensor:
        """``check_scores`` of a batch's total, except that the NaN of the rows the latest :meth:`score`
        left unscored pass whatever ``allow_nonfinite`` says (a declared "not applicable", not a fault)."""
        unscored, self.unscored = self.unscored, None
        if allow_nonfinite or unscored is None or len(unscored) != batch_size or not unscored.any():
            return check_scores(scores, batch_size, name, device, allow_nonfinite)
        raw = check_scores(scores, batch_size, name, device, allow_nonfinite=True)
        check_scores(raw.masked_fill(unscored.to(raw.device), 0.0), batch_size, name, device)  # any other NaN
        return raw

    @property
    def seen_unscored(self) -> bool:
        """Whether a row went unscored in this run: ``reward/unscored`` is logged from then on, and the
        warning about it was given (saved with checkpoints: ``checkpoint.PPOState``)."""
        return self._seen_unscored

    @seen_unscored.setter
    def seen_unscored(self, seen: bool) -> None:
        self._seen_unscored = self._warned = seen

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    def _log_extra(self, batch_size: int, column: str, values: Any) -> None:
        values = list(values)
        if len(values) != batch_size:
            raise ValueError(
                f"log_extra({column!r}, values) needs one value per completion ({batch_size}), "
                f"got {len(values)}"
            )
        self.columns[column] = values

    def _report(self, module: Any, prefix: str | None, batch_size: int) -> None:
        """Log what the rewards gave ``log_metric``, count the unscored rows, warn about them once."""
        count = int(self.unscored.sum())
        if count and not self._warned:
            self._warned = True
            warn(
                f"{count} of {batch_size} completions were scored by no reward (every reward returned None "
                "for them): they are left out of the update and of their group's baseline, and counted "
                "in reward/unscored (this warning is shown once)"
            )
        self._seen_unscored |= bool(count)
        if prefix is None:
            return
        if self._seen_unscored:
            module.log(f"{prefix}/unscored", float(count), batch_size=batch_size)
        for name in sorted(self._metrics):
            values = self._metrics[name]
            module.log(f"{prefix}/{name}", sum(values) / len(values), batch_size=batch_size)


def reward_components(module: Any) -> list[tuple[str, Any]]:
    """(name, ``f(prompts, completions, batch)``) of each of ``module``'s rewards, in weight order."""
    components: list[tuple[str, Any]] = [(call.name, call) for call in module.reward_calls]
    model, adapter = module.reward_model, module.reward_adapter
    if model is not None:
        components.append(("reward_model", lambda p, c, b: model.score(p, c, b.rollout, b.messages)))
    if adapter is not None:
        components.append(("reward_adapter", lambda p, c, b: adapter(*_sequences(b))))
    return components


def _sequences(batch: ScoreInputs) -> tuple[Tensor, Tensor, Tensor]:
    rollout = batch.rollout
    return rollout.input_ids, rollout.attention_mask, rollout.position_ids


def log_prefix(module: Any) -> str | None:
    """``reward``, ``eval/reward`` while validating, ``None`` outside a Trainer (nothing to log to)."""
    if module._trainer is None:
        return None
    return "eval/reward" if module.trainer.validating else "reward"


def trainer_state(module: Any) -> TrainerState:
    """The run's progress in PPO iterations (see :class:`lightning_ppo.rewards.TrainerState`)."""
    trainer = module._trainer
    if trainer is None:
        return TrainerState(global_step=module.iteration)
    batches = trainer.num_training_batches
    limits = []
    if trainer.max_steps is not None and trainer.max_steps > 0:
        steps_per_iteration = module.ppo.ppo_epochs * module.ppo.num_minibatches
        limits.append(-(-trainer.max_steps // steps_per_iteration))
    epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else -1
    done = 0.0
    if math.isfinite(batches) and batches > 0:
        if epochs >= 0:
            limits.append(epochs * int(batches))
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed / batches
    return TrainerState(
        global_step=module.iteration,
        max_steps=min(limits) if limits else -1,
        epoch=trainer.current_epoch + done,
        num_train_epochs=epochs,
        is_world_process_zero=trainer.is_global_zero,
        is_local_process_zero=trainer.local_rank == 0,
    )


def split_none(output: Any) -> tuple[Any, Tensor | None]:
    """A reward's output with ``None`` rows as 0, and which rows it scored (``None``: all of them)."""
    if getattr(getattr(output, "dtype", None), "kind", None) == "O":  # a numpy array holding None
        output = output.tolist()
    if not isinstance(output, (list, tuple)) or all(value is not None for value in output):
        return output, None
    applies = torch.tensor([value is not None for value in output])
    return [0.0 if value is None else value for value in output], applies


def call_all(
    rewards: list[Any], prompts: list[str], completions: list[str], batch: ScoreInputs, names: list[str]
) -> list[Any]:
    """Each reward's output, in order; an async reward's is still to be awaited (:func:`await_all`)."""
    outputs: list[Any] = []
    try:
        for reward, name in zip(rewards, names, strict=True):
            outputs.append(_called(reward, name, prompts, completions, batch))
    except BaseException:
        for output in outputs:  # never to be awaited: close them rather than warn about them
            if inspect.iscoroutine(output):
                output.close()
        raise
    return outputs


def _called(reward: Any, name: str, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Any:
    """``reward(...)``; its ``sys.exit()`` stops the run in one line, as an async reward's does, rather
    than end ``fit`` as if it had finished. A ``KeyboardInterrupt`` on the main thread is the run's
    Ctrl-C (one cannot be told from the other there: SIGINT lands wherever the main thread is); on
    another (sampling ahead) it can only be the code's own, and stops the run as an exit does. A
    ``StopIteration`` (``next()`` over no match) becomes a ``RuntimeError``, as in a generator (PEP 479):
    Lightning's loop would take it for the end of the data and end the run in silence."""
    try:
        return reward(prompts, completions, batch)
    except StopIteration as err:
        raise RuntimeError(f"reward {name!r} raised StopIteration: {err}") from err
    except SystemExit as err:
        raise call_exited(f"reward {name!r}", err) from err
    except KeyboardInterrupt as err:
        if threading.current_thread() is threading.main_thread():
            raise
        raise call_exited(f"reward {name!r}", err) from err


def await_all(
    outputs: list[Any],
    timeout: float | None = None,
    names: list[str] | None = None,
    batch_size: int = 0,
    drop: bool = False,
) -> list[Any]:
    """``outputs`` with every awaitable replaced by its result, all awaited together on the reward
    loop, each within ``timeout`` seconds. One that takes longer is a one-line error, or, under
    ``ppo.on_bad_reward: drop``, NaN for every completion (dropped and counted as NaN scores are)."""
    waiting = [i for i, output in enumerate(outputs) if inspect.isawaitable(output)]
    done = list(outputs)
    shown = [f"reward {names[i]!r}" if names is not None else f"reward {i}" for i in waiting]
    outcomes = await_bounded([outputs[i] for i in waiting], timeout, shown)
    for i, outcome in zip(waiting, outcomes, strict=True):
        if isinstance(outcome.error, RuntimeError) and isinstance(outcome.error.__cause__, StopIteration):
            # Python's own 'coroutine raised StopIteration' (PEP 479) names no reward; a plain one's does
            stop = outcome.error.__cause__
            raise RuntimeError(f"{shown[waiting.index(i)]} raised StopIteration: {stop}") from stop
        if outcome.error is not None:
            raise outcome.error  # the reward's own exception, as a plain reward's would propagate
        if outcome.timed_out:
            name = names[i] if names is not None else f"reward {i}"
            if not drop:
                raise UsageError(
                    f"reward {name!r} did not answer within {timeout} s (ppo.reward_timeout); "
                    "ppo.on_bad_reward: drop leaves its completions out of the update instead"
                )
        done[i] = [math.nan] * batch_size if outcome.timed_out else outcome.value
    return done
