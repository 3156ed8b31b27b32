"""The selfcheck's multi-turn task: the first reply steers a random hint, the second is scored on it.

After the policy's first reply the environment reveals a hint, ``x`` or ``y``, drawn at random: ``x``
with probability 0.9 when the reply starts with ``z``, else 0.5. The second reply earns
``count(hint) / 2``, plus 0.5 when the hint is the prompt's own character; then the episode ends.
So the first reply pays off only through the hint it makes likely (``z`` first for the prompt
``x``, anything else for ``y``), which a critic must learn from the prompt and the reply, and the
second must read the hint. Every episode is listed: 13 first replies of at most two tokens, 2 hints,
13 second replies; the optimum follows by backward induction (:mod:`.induction`).
"""

from __future__ import annotations

import random
from typing import Any

from lightning_ppo.rollout.environment import Environment, StepResult, Turn

HINTS = ("x", "y")
STEER = "z"  # a first reply starting with it makes the hint x likely


def hint_probabilities(first_reply: str) -> tuple[float, ...]:
    """The probability of each of :data:`HINTS` after ``first_reply`` (its text)."""
    x = 0.9 if first_reply.startswith(STEER) else 0.5
    return (x, 1 - x)


def hint_reward(prompt: str, hint: str, second_reply: str, length: int) -> float:
    """The second reply's reward: the share of ``length`` positions holding the hint, plus 0.5 when the
    hint is the prompt."""
    return second_reply.count(hint) / length + (0.5 if hint == prompt else 0.0)


class HintEnvironment(Environment):
    """The hint task's environment (two turns; ``episode.max_turns: 2``).

    Args:
        length: The reply length budget (``generation.max_new_tokens``).
    """

    def __init__(self, length: int = 2) -> None:
        self.length = length
        self.prompt = self.hint = ""
        self.rng = random.Random(0)

    def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> None:
        self.prompt, self.rng = prompt, rng

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 0:
            self.hint = HINTS[0] if self.rng.random() < hint_probabilities(turn.text)[0] else HINTS[1]
            return StepResult(observation=self.hint)
        return StepResult(reward=hint_reward(self.prompt, self.hint, turn.text, self.length), done=True)
