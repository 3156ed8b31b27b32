"""Every rank's answers, for the statistics that warn: the diversity metrics and the guardrails'
collapse and converging checks judge the global batch, not one rank's part of it.

A mean of per-rank shares is not the batch's share: two ranks that each answer half their prompts
with one phrase may use two different phrases, and distinct-n of a part depends on the part's
size. So the host gathers the answers once per iteration, and every rank computes the same numbers
from them. What travels is short: a digest of each prompt (the checks only ask whether two prompts
are the same one) and each completion's text (the checks read its words and quote one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


def prompt_key(prompt: str) -> str:
    """A short stand-in for a prompt: equal prompts, equal keys (16 hex digits of BLAKE2b)."""
    return hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class BatchAnswers:
    """The iteration's answers over every rank, in rank order: a key per prompt, and the text."""

    prompts: list[str]  # prompt_key of each row's prompt
    completions: list[str]

    @classmethod
    def gathered(cls, trainer: Any, prompts: list[str], completions: list[str]) -> BatchAnswers:
        """Every rank's rows; every rank must call this (one all-gather under several ranks)."""
        mine = ([prompt_key(p) for p in prompts], list(completions))
        world = 1 if trainer is None else trainer.world_size
        if world == 1 or not torch.distributed.is_initialized():
            return cls(*mine)
        everyone: list[Any] = [None] * world
        torch.distributed.all_gather_object(everyone, mine)
        return cls(
            [key for keys, _ in everyone for key in keys],
            [text for _, texts in everyone for text in texts],
        )
