"""The environment protocol of multi-turn episodes: what a user subclasses (:class:`Environment`),
what it receives (:class:`Turn`) and answers (:class:`StepResult`). The runner that drives it is
``lightning_ppo.rollout.episodes`` (which re-exports these, the names configs use); tools build on it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One reply of the policy, as the environment receives it."""

    index: int  # 0 for the first reply
    text: str  # decoded, without the stop token
    token_ids: list[int]  # as sampled, the stop token included when the reply has one
    ended: bool  # whether the reply emitted the stop token (False: cut at max_new_tokens)


@dataclass
class StepResult:
    """The environment's answer to a turn.

    Attributes:
        observation: Text appended after the turn for the policy to read (tokenized without special
            tokens), or a chat message ``{"role": "user", "content": ...}`` that the tokenizer's chat
            template renders after the reply, opening the assistant's next turn; ``None`` or ``""``
            appends nothing.
        reward: This turn's reward, added on the turn's last token; ``None`` for none.
        done: The episode ends here (it also ends after ``episode.max_turns`` turns).
    """

    observation: str | dict[str, str] | None = None
    reward: float | None = None
    done: bool = False


class Environment:
    """What the policy talks to in a multi-turn episode. Subclass it and override both methods.

    Each episode gets its own deep copy of the configured instance, so ``self`` can hold the
    episode's state. What must not be copied, a large read-only table (a copy per episode per batch
    costs ~0.4 s for 100k dict entries: ``benchmarks/env_copies.py``) or what cannot be (a lock, a
    client, a socket), is named in :attr:`shared`: those attributes are the configured instance's
    own objects in every copy, shared by all episodes (and, with plain ``def`` methods, touched from
    several threads at once). Randomness should come from the ``rng`` given to :meth:`reset`: it is seeded
    from the run's seed, the iteration, the rank and the episode, so runs (and resumed runs) repeat.

    Both methods may be ``async def``. A batch's calls run together, ``episode.max_concurrency`` at
    once, each within ``episode.step_timeout`` (``lightning_ppo.runs.bounded_calls``): plain ones on
    threads of their own, async ones on the run's event loop (which a blocking call inside them
    would stop: that is one line naming the class).
    """

    shared: tuple[str, ...] = ()  # attribute names every episode's copy shares rather than copies

    def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> None:
        """Start an episode on ``prompt`` (as the policy reads it) and its dataset ``row`` (the other
        columns). The default keeps nothing."""

    def step(self, turn: Turn) -> StepResult:
        """Answer the policy's turn."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn) -> StepResult")

    def own_words(self, reply: str) -> str:
        """The policy's own words in ``reply`` (a turn's text): what the checks of how varied the
        answers are compare (``lightning_ppo.watch.diversity``), never the observations. The default:
        all of it. Override it to leave out markup every reply shares (an action's wrapper), which
        would read as answers converging on it."""
        return reply


class StepFunction(Environment):
    """A stateless environment: ``fn(turn, row) -> StepResult``, ``row`` the episode's dataset row
    (given to ``model.environment`` by import path, e.g. ``my_pkg.env.step``)."""

    def __init__(self, fn: Callable[[Turn, dict[str, Any]], StepResult]) -> None:
        self.fn = fn
        self.row: dict[str, Any] = {}

    def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> None:
        self.row = row

    def step(self, turn: Turn) -> StepResult:
        return self.fn(turn, self.row)
