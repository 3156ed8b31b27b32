"""A batch of tokenized prompts: what :class:`~lightning_ppo.data.PromptDataModule` serves and what
generation and the episodes start from (``lightning_ppo.data`` re-exports it); and the warning that
its prompts end with the stop token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_ppo.runs.warn import warn


@dataclass
class PromptBatch:
    """A batch of tokenized prompts.

    Attributes:
        prompt_ids: ``(B, P)`` long tensor, left padded with the tokenizer's pad token id so that
            generation continues right after the last real token of every row.
        prompt_mask: ``(B, P)`` bool tensor, True on real tokens. Built from the prompt lengths, so it
            stays correct when the pad token doubles as a real token (pad == eos).
        prompts: prompt text as the policy sees it (after the chat template; a prompt cut to
            ``max_prompt_length`` tokens is the decoded text of the tokens kept).
        extras: every other dataset column, one value per sample (e.g. a reference answer).
        messages: the conversations of a conversational dataset (lists of ``{"role", "content"}``
            messages) as given, before the chat template; ``None`` for text prompts.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    prompts: list[str]
    extras: dict[str, list] = field(default_factory=dict)
    messages: list[list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def repeat_interleave(self, n: int) -> PromptBatch:
        """Each prompt ``n`` times in a row (group sampling: the group of a prompt stays contiguous)."""
        if n == 1:
            return self
        return PromptBatch(
            prompt_ids=self.prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=self.prompt_mask.repeat_interleave(n, dim=0),
            prompts=[p for p in self.prompts for _ in range(n)],
            extras={k: [v for v in values for _ in range(n)] for k, values in self.extras.items()},
            messages=None if self.messages is None else [m for m in self.messages for _ in range(n)],
        )


@dataclass
class PromptEndWarning:
    """Once per run: a prompt ending with the stop token (a tokenizer's trailing ``[SEP]``) asks the
    policy to continue after a stop, which nothing in training ever rewards."""

    tokenizer: PreTrainedTokenizerBase
    stop_token_id: int
    warned: bool = False

    def check(self, batch: PromptBatch) -> None:
        """Warn (rank 0) if this batch's prompts end with the stop token and no warning was given yet."""
        if self.warned or not (batch.prompt_ids[:, -1] == self.stop_token_id).any():
            return  # prompts are left padded: the last column holds every prompt's last token
        self.warned = True
        token = self.tokenizer.convert_ids_to_tokens(self.stop_token_id)
        warn(
            f"prompts end with the stop token {token!r}, probably added by the tokenizer: set "
            "`data.add_special_tokens: false`, or another `generation.stop_token`"
        )
