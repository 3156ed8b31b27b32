"""Every response a causal LM can give to a prompt within a few tokens, with its exact log-prob.

A response is what the rollout samples: tokens up to and including the stop token, or
``max_new_tokens`` tokens without it (truncated). With the suppressed tokens left out, ``A`` tokens
that are not the stop token and ``L`` new tokens make ``A^L`` truncated responses and
``(A^L - 1) / (A - 1)`` ended ones. One forward over the ``A^L`` longest sequences gives the
next-token distribution after every prefix, so every response's log-prob, in float64, under the
sampling distribution the trainer's log-probs use (temperature, suppressed tokens).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Response:
    """One response: its token ids (the stop token last when it ended) and whether it ended."""

    token_ids: tuple[int, ...]
    ended: bool


@dataclass(frozen=True)
class ResponseSpace:
    """What a rollout can sample: the tokens it may draw and how many.

    Attributes:
        tokens: The token ids sampling may draw other than the stop token (not suppressed).
        stop_token_id: The token that ends a response.
        max_new_tokens: The most tokens a response has.
        temperature: The sampling temperature.
    """

    tokens: tuple[int, ...]
    stop_token_id: int
    max_new_tokens: int
    temperature: float = 1.0

    def responses(self) -> list[Response]:
        """Every response, shortest first: the ended ones of each length, then the truncated ones."""
        out = []
        for length in range(self.max_new_tokens):
            for prefix in itertools.product(self.tokens, repeat=length):
                out.append(Response((*prefix, self.stop_token_id), ended=True))
        for full in itertools.product(self.tokens, repeat=self.max_new_tokens):
            out.append(Response(full, ended=False))
        return out

    def logprobs(self, exact: nn.Module, prompt_ids: list[int]) -> Tensor:
        """(N,) float64 log-prob of each of :meth:`responses` after ``prompt_ids`` (any context: a
        prompt, or a prompt and the turns so far) under ``exact``, a causal LM in float64
        (:func:`float64_copy`)."""
        longest = list(itertools.product(self.tokens, repeat=self.max_new_tokens))
        ids = torch.tensor([list(prompt_ids) + list(seq) for seq in longest], dtype=torch.long)
        with torch.no_grad():
            logits = exact(input_ids=ids.to(next(exact.parameters()).device)).logits.double().cpu()
        # next-token log-probs after the prompt and each prefix: positions len(prompt) - 1 .. + L - 1
        start = len(prompt_ids) - 1
        logits = logits[:, start : start + self.max_new_tokens] / self.temperature
        allowed = torch.tensor([*self.tokens, self.stop_token_id])
        masked = torch.full_like(logits, -torch.inf)
        masked[..., allowed] = logits[..., allowed]
        step = masked.log_softmax(dim=-1)  # (A^L, L, V)
        index = {seq: row for row, seq in enumerate(longest)}
        pad = self.tokens[0]  # any continuation: a prefix's distributions do not depend on it
        values = []
        for response in self.responses():
            body = response.token_ids[:-1] if response.ended else response.token_ids
            row = step[index[(*body, *[pad] * (self.max_new_tokens - len(body)))]]
            logp = sum(float(row[t, token]) for t, token in enumerate(response.token_ids))
            values.append(logp)
        return torch.tensor(values, dtype=torch.float64)


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` in eval mode, on its device; the model itself is left as it is."""
    return copy.deepcopy(model).double().eval()
