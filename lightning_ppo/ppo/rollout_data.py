"""The rollout as the update receives it: prompts, the responses sampled for them and their masks.

It lives with the update's data (``ppo/``) because every step after sampling reads it: the
experience, the rewards, the metrics. The engines in ``rollout/`` produce it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Rollout:
    """Prompts and the responses sampled for them.

    ``response_mask`` marks the policy's own tokens, its actions: True up to and including the first
    stop token (or over every token of a response that never stopped). It comes from the position
    of the stop token, never by comparing ids with the pad id, so pad == eos is safe.

    A multi-turn episode (``lightning_ppo.rollout.episodes``) keeps every turn in the response region, in
    order: the policy's tokens as sampled (``response_mask``) and between them the environment's
    observations (``context_mask``), which the policy reads but never acted: they take part in
    attention and in nothing else (no log-prob, KL, entropy, policy or value loss).
    """

    prompt_ids: Tensor  # (B, P) long, left padded
    prompt_mask: Tensor  # (B, P) bool
    response_ids: Tensor  # (B, R) long, pad after the stop token
    response_mask: Tensor  # (B, R) bool
    ended: Tensor  # (B,) bool, whether the response emitted the stop token
    # (B, R) the sampling engine's own log-probs of the response tokens, 0 past each response's
    # end; None where the trainer's weights sampled (HF generate), so there is nothing to compare.
    engine_logprobs: Tensor | None = None
    # (B, R) True on observation tokens between a multi-turn episode's turns; None for one turn.
    context_mask: Tensor | None = None
    # (B, R) rewards an environment gave, each on the last token of its turn; None when none did.
    turn_rewards: Tensor | None = None

    @property
    def episode_mask(self) -> Tensor:
        """(B, R) True on every real token after the prompt: the policy's and the observations."""
        return self.response_mask if self.context_mask is None else self.response_mask | self.context_mask

    @property
    def input_ids(self) -> Tensor:
        """(B, P + R) prompt and response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + R) True on real prompt and response tokens (observations included)."""
        return torch.cat([self.prompt_mask, self.episode_mask], dim=1)

    @property
    def position_ids(self) -> Tensor:
        """(B, P + R) positions counted from each row's first real token, as generation used them."""
        return position_ids_from_mask(self.attention_mask)

    @property
    def response_lengths(self) -> Tensor:
        """(B,) number of the policy's real response tokens, stop tokens included."""
        return self.response_mask.sum(dim=1)

    def rows(self, index: Tensor) -> Rollout:
        """The rollout of the rows ``index`` (a long tensor) only, in that order."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Rollout(**{name: None if value is None else value[index] for name, value in values.items()})

    def episode_token_ids(self) -> list[list[int]]:
        """Each row's tokens after the prompt, without padding (one turn: the response with its stop
        token; several: every turn's tokens and the observations between them)."""
        return [row[keep].tolist() for row, keep in zip(self.response_ids, self.episode_mask, strict=True)]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: HF generation computes them the same way."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
