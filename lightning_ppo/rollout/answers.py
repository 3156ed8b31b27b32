"""An environment's answers, checked as reward functions' are, and its failures named.

Each call to an environment (``reset``, ``step``) comes back as an
:class:`~lightning_ppo.runs.bounded_calls.Outcome`. :func:`step_result` turns a ``step``'s outcome
into a :class:`StepResult` the runner can trust, or raises, in one line naming the class, the turn
and the prompt:

- :class:`EnvironmentFailure`: the call raised; :class:`EnvironmentTimeout`: it did not answer
  within ``episode.step_timeout``; both handled as ``episode.on_error`` says (stop, or drop the
  episode and count it);
- :class:`BadEnvironmentReward`: a NaN or infinite reward, handled as ``ppo.on_bad_reward`` says
  for reward functions (stop, or drop the episode and count it): never NaN into the loss;
- :class:`~lightning_ppo.runs.errors.UsageError`: an answer of the wrong type (not a
  ``StepResult``, a reward that is not a number, an observation that is neither text nor a
  message): a mistake in the environment's code, which stops the run whatever the settings say.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from lightning_ppo.rollout.environment import StepResult
from lightning_ppo.runs.bounded_calls import Outcome
from lightning_ppo.runs.errors import UsageError


class EnvironmentFailure(UsageError, RuntimeError):
    """An environment's ``reset`` or ``step`` raised: named with its class, turn and prompt."""


class EnvironmentTimeout(EnvironmentFailure):
    """An environment's ``reset`` or ``step`` did not answer within ``episode.step_timeout``."""


class BadEnvironmentReward(EnvironmentFailure):
    """A step's reward was NaN or infinite."""


def where(owner: str, method: str, turn: int, prompt: str) -> tuple[str, str]:
    """``model.environment: Class.step`` and, for the end of the line, the turn and the prompt."""
    return f"model.environment: {owner}.{method}", f"(turn {turn}, prompt {prompt[:60]!r})"


def value_of(outcome: Outcome, owner: str, method: str, turn: int, prompt: str, timeout: float | None) -> Any:
    """The call's value, or the failure it was, raised."""
    name, place = where(owner, method, turn, prompt)
    if outcome.timed_out:
        raise EnvironmentTimeout(f"{name} did not answer within {timeout} s (episode.step_timeout) {place}")
    if outcome.error is not None:
        error = outcome.error
        raise EnvironmentFailure(f"{name} raised {type(error).__name__}: {error} {place}") from error
    return outcome.value


def step_result(outcome: Outcome, owner: str, turn: int, prompt: str, timeout: float | None) -> StepResult:
    """A ``step``'s outcome as a checked :class:`StepResult` (its reward a float or ``None``)."""
    result = value_of(outcome, owner, "step", turn, prompt, timeout)
    name, place = where(owner, "step", turn, prompt)
    if not isinstance(result, StepResult):
        raise UsageError(f"{name} must return a StepResult, got {type(result).__name__} {place}")
    _check_observation(result.observation, name, place)
    reward = _reward(result.reward, name, place)
    if reward is not None and not math.isfinite(reward):
        raise BadEnvironmentReward(
            f"{name} returned the reward {reward} {place}; ppo.on_bad_reward: drop leaves such "
            "episodes out of the update"
        )
    return StepResult(result.observation, reward, bool(result.done))


def _reward(value: Any, name: str, place: str) -> float | None:
    """A reward as a float: a Python or NumPy number, or a tensor holding one; ``None`` stays."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.detach().reshape(()).item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    raise UsageError(
        f"{name} returned the reward {value!r} ({type(value).__name__}{shape}) {place}: expected a "
        "number or None"
    )


def _check_observation(observation: Any, name: str, place: str) -> None:
    if observation is None or isinstance(observation, str):
        return
    if (
        isinstance(observation, dict)
        and isinstance(observation.get("content"), str)
        and "role" in observation
    ):
        return
    raise UsageError(
        f"{name} returned the observation {observation!r} ({type(observation).__name__}) {place}: "
        "expected text, a chat message {'role': ..., 'content': str}, or None"
    )
