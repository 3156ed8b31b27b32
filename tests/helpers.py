"""Importable test doubles selected by class_path in CLI tests (real classes, not mocks)."""

from __future__ import annotations

import torch

from lightning_ppo import PPOLightningModule
from lightning_ppo.rewards import RewardFunction


class CountCharReward(RewardFunction):
    """Fraction of completion characters equal to ``char`` (0 for an empty completion)."""

    def __init__(self, char: str = "7") -> None:
        self.char = char

    def __call__(self, prompts, completions, batch):
        return [c.count(self.char) / max(len(c), 1) for c in completions]


class ShortAnswerModule(PPOLightningModule):
    """A subclass with its own reward: 1 for a response of at most two characters, else 0.

    It records what ``score`` received so tests can check the batch carried the extra columns.
    """

    seen_extras: list[dict] = []

    def score(self, prompts, completions, batch):
        ShortAnswerModule.seen_extras.append(dict(batch.extras))
        return torch.tensor([1.0 if len(c) <= 2 else 0.0 for c in completions])


def count_sevens(prompts, completions, batch):
    """A plain function reward: the number of '7' characters in each completion."""
    return [float(c.count("7")) for c in completions]
