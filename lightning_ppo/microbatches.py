"""The micro-batches of a minibatch, and the shares that make their gradients add up to its own.

A minibatch is split for gradient accumulation either into ``gradient_accumulation_steps`` equal
counts of sequences (in order), or, with ``ppo.micro_batch_tokens``, by a token budget: sequences
sorted by length and packed greedily so that each micro-batch's rectangle (rows x its longest
sequence) stays within the budget, grouping similar lengths. Every micro-batch is then trimmed to
its own longest sequence (:meth:`Experience.trimmed`), so short ones pay for short rectangles.

Each loss term is a mean over the micro-batch's tokens (or, for the policy term under
``sequence_mean`` and ``constant`` aggregation, over its responses). Summing micro-batch means
divided by their count (what accumulation usually does) weighs a token of a micro-batch with few
tokens more than one of a full micro-batch; instead each mean is weighted by its micro-batch's
share of the minibatch's tokens (or responses), which gives exactly the minibatch's own mean:
the same update as one unsplit pass, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_ppo.experience import Experience


@dataclass(frozen=True)
class Share:
    """A micro-batch's share of its minibatch: of the real response tokens, of the responses with
    at least one (what ``sequence_mean`` averages over) and of the rows (``constant``'s divisor)."""

    tokens: float = 1.0
    responses: float = 1.0
    rows: float = 1.0

    def of_policy_term(self, aggregation: str) -> float:
        """The share that weighs the policy (and in-loss KL) term under ``aggregation``."""
        return {"sequence_mean": self.responses, "constant": self.rows}.get(aggregation, self.tokens)


def plan_micro_batches(
    minibatch: Experience, count: int, token_budget: int | None = None
) -> list[tuple[Experience, Share]]:
    """The micro-batches of ``minibatch``, each trimmed, with their shares."""
    if count == 1 and not token_budget:
        return [(minibatch.trimmed(), Share())]
    groups = _by_budget(minibatch, token_budget) if token_budget else _by_count(len(minibatch), count)
    device = minibatch.input_ids.device
    lengths = minibatch.response_mask.sum(dim=1).float()
    # per row: its tokens, whether it has any, 1; over the minibatch, the totals they are shares of
    per_row = torch.stack([lengths, (lengths > 0).float(), torch.ones_like(lengths)], dim=1)
    totals = per_row.sum(dim=0).clamp(min=1)
    micros = [minibatch.select(g.to(device)) for g in groups]
    # The shares and every micro-batch's padding bounds in one host read for the whole plan.
    shares = torch.stack([per_row[g.to(device)].sum(dim=0) / totals for g in groups])
    bounds = torch.stack([m.padding_bounds() for m in micros])
    read = torch.cat([shares, bounds.to(shares.dtype)], dim=1).tolist()
    return [(m.trimmed([int(r[3]), int(r[4])]), Share(*r[:3])) for m, r in zip(micros, read, strict=True)]


def _by_count(size: int, count: int) -> list[torch.Tensor]:
    return list(torch.arange(size).chunk(count))


def _by_budget(minibatch: Experience, budget: int) -> list[torch.Tensor]:
    """Row indices sorted by sequence length (prompt + response tokens), packed greedily so that
    rows x longest <= budget (a sequence longer than the budget goes alone)."""
    lengths = minibatch.attention_mask.sum(dim=1).cpu()
    order = torch.argsort(lengths, stable=True).tolist()
    groups: list[list[int]] = []
    for row in order:
        longest = int(lengths[row])  # sorted ascending: the newest row is the longest so far
        if groups and (len(groups[-1]) + 1) * longest <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return [torch.tensor(g) for g in groups]
