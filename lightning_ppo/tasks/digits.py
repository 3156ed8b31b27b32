"""The quickstart task: answer with the digits of the prompt.

Prompt ``"47192="``. By default a response earns credit for each of its first five characters
that is one of the prompt's digits (``"29417"`` and ``"47192"`` both score 1.0, ``"4x"`` 0.2);
with ``in_order=True`` only characters in the same place as in the prompt count (an exact copy,
a harder task). Either way the credit is divided by ``max(len(target), len(response))``, so a
response that runs on past five characters costs. Prompts are generated in code: no download.
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


class DigitsDataModule(PromptDataModule):
    """Synthetic digit prompts, with the answer in the ``target`` column.

    Args:
        num_prompts: Training prompts generated.
        num_val_prompts: Held-out prompts generated for validation.
        num_digits: Digits per prompt.
        **kwargs: Everything ``PromptDataModule`` takes (batch size, prompt length, seed, ...).
    """

    def __init__(
        self, num_prompts: int = 20000, num_val_prompts: int = 0, num_digits: int = 5, **kwargs: Any
    ) -> None:
        if num_val_prompts and kwargs.get("val_split") is None:
            kwargs["val_split"] = "validation"
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


def digits_score(completion: str, target: str, in_order: bool = False) -> float:
    """Credit for the first ``len(target)`` characters, over the longer of response and target.

    A character earns credit when it is one of the target's digits, or, with ``in_order``, when it
    equals the target's character at the same place.
    """
    head = completion[: len(target)]
    if in_order:
        matches = sum(a == b for a, b in zip(head, target, strict=False))
    else:
        matches = sum(ch in target for ch in head)
    return matches / max(len(target), len(completion), 1)


class DigitsReward(RewardFunction):
    """Scores a completion by :func:`digits_score` against the ``target`` column.

    Args:
        in_order: Count only characters in the same place as in the prompt (exact copy).
    """

    def __init__(self, in_order: bool = False) -> None:
        self.in_order = in_order

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor:
        if "target" not in batch.extras:
            raise KeyError(f"DigitsReward needs a 'target' column; the batch has {sorted(batch.extras)}")
        targets = batch.extras["target"]
        return torch.tensor(
            [digits_score(c, t, self.in_order) for c, t in zip(completions, targets, strict=True)],
            dtype=torch.float32,
        )


def exact_length(prompts: list[str], completions: list[str], batch: ScoreInputs) -> list[float]:
    """A plain-function reward: 1.0 when the completion is exactly as long as the prompt's digits."""
    return [float(len(c) == len(p.rstrip("="))) for p, c in zip(prompts, completions, strict=True)]
