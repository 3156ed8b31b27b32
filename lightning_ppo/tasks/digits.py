"""The quickstart task: copy the digits before the ``=`` sign.

Prompt ``"47192="``, ideal response ``"47192"`` then the stop token. The score is the fraction
of characters in the right place: ``matches / max(len(target), len(response))``, so 1.0 is an
exact copy, a response of the right digits in the wrong order earns little, and padding a
response with extra characters costs. Prompts are generated in code: no download.
"""

from __future__ import annotations

import random
from typing import Any

import datasets
import torch
from torch import Tensor

from lightning_ppo.data import PromptDataModule
from lightning_ppo.rewards import RewardFunction, ScoreInputs


def digit_prompts(num: int, num_digits: int, seed: int) -> dict[str, list[str]]:
    """``num`` prompts of ``num_digits`` random digits followed by ``=``, with their targets."""
    rng = random.Random(seed)
    targets = ["".join(rng.choice("0123456789") for _ in range(num_digits)) for _ in range(num)]
    return {"prompt": [f"{t}=" for t in targets], "target": targets}


class DigitCopyDataModule(PromptDataModule):
    """Synthetic copy-the-digits prompts, with the answer in the ``target`` column.

    Args:
        num_prompts: Training prompts generated.
        num_val_prompts: Held-out prompts generated for validation.
        num_digits: Digits per prompt.
        **kwargs: Everything ``PromptDataModule`` takes (batch size, prompt length, seed, ...).
    """

    def __init__(
        self, num_prompts: int = 20000, num_val_prompts: int = 0, num_digits: int = 5, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.num_prompts, self.num_val_prompts, self.num_digits = num_prompts, num_val_prompts, num_digits

    def load_dataset(self) -> datasets.DatasetDict:
        splits = {
            "train": datasets.Dataset.from_dict(digit_prompts(self.num_prompts, self.num_digits, self.seed))
        }
        if self.num_val_prompts:
            val = digit_prompts(self.num_val_prompts, self.num_digits, self.seed + 1)
            splits["validation"] = datasets.Dataset.from_dict(val)
        return datasets.DatasetDict(splits)


def copy_score(completion: str, target: str) -> float:
    """Fraction of characters in the right place, over the longer of response and target."""
    matches = sum(a == b for a, b in zip(completion, target, strict=False))
    return matches / max(len(target), len(completion), 1)


class DigitCopyReward(RewardFunction):
    """Scores a completion by :func:`copy_score` against the ``target`` column."""

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor:
        if "target" not in batch.extras:
            raise KeyError(f"DigitCopyReward needs a 'target' column; the batch has {sorted(batch.extras)}")
        targets = batch.extras["target"]
        return torch.tensor([copy_score(c, t) for c, t in zip(completions, targets, strict=True)])
