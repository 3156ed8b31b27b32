"""A multi-turn task the policy cannot solve without reading the environment.

The prompt is only ``"="``. Whatever the policy answers first, the environment then reveals five
digits (``"47192="``, from the row's hidden ``target`` column) and asks, in effect, for them back:
the second reply is scored like the quickstart's (:func:`~lightning_ppo.tasks.digits.digits_score`)
and the episode ends. The digits are in no prompt, so a policy that ignores the observation earns
what a random one does (about 0.25).
"""

from __future__ import annotations

import random
from typing import Any

import datasets

from lightning_ppo.rollout.episodes import Environment, StepResult, Turn
from lightning_ppo.tasks.digits import DigitsDataModule, digits_score


class RevealDigits(Environment):
    """Reveals the row's ``target`` digits after the first turn; rewards repeating them in the second.

    Args:
        in_order: Score only digits in the same place (an exact copy), as ``DigitsReward`` does.
    """

    def __init__(self, in_order: bool = False) -> None:
        self.in_order = in_order
        self.target = ""

    def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> None:
        if "target" not in row:
            raise KeyError(f"RevealDigits needs a 'target' column; the row has {sorted(row)}")
        self.target = row["target"]

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 0:
            return StepResult(observation=f"{self.target}=")
        return StepResult(reward=digits_score(turn.text, self.target, self.in_order), done=True)


class RevealDigitsDataModule(DigitsDataModule):
    """Prompts that are only ``"="``, with the digits to reveal in the ``target`` column."""

    def load_dataset(self) -> datasets.DatasetDict:
        splits = super().load_dataset()
        return datasets.DatasetDict(
            {name: split.map(lambda row: {"prompt": "="}) for name, split in splits.items()}
        )


def reveal_step(turn: Turn, row: dict[str, Any]) -> StepResult:
    """:class:`RevealDigits` as a stateless ``step`` function (``model.environment`` by import path)."""
    if turn.index == 0:
        return StepResult(observation=f"{row['target']}=")
    return StepResult(reward=digits_score(turn.text, row["target"]), done=True)
