"""The micro-batches of a minibatch, and the shares that make their gradients add up to its own.

A minibatch is split, its sequences sorted by length, into runs of similar lengths chosen to
leave out as much padding as an extra forward is worth (:mod:`lightning_ppo.row_groups`), whose
rectangles (rows x (longest prompt + longest response)) stay within ``ppo.micro_batch_tokens``
where it is set; or, for ``gradient_accumulation_steps`` > 1, into that many equal counts of
them (under FSDP2 without a budget, one: see plan_micro_batches). Every micro-batch is
then trimmed to its own longest prompt and response (:meth:`Experience.trimmed`), so short ones
pay for short rectangles.

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
from torch import Tensor

from lightning_ppo.experience import Experience
from lightning_ppo.row_groups import equal_groups, plan_row_groups, row_extents


@dataclass(frozen=True)
class Share:
    """A micro-batch's share of its minibatch: of the real response tokens, of the responses with
    at least one (what ``sequence_mean`` averages over) and of the rows (``constant``'s divisor)."""

    tokens: float = 1.0
    responses: float = 1.0
    rows: float = 1.0
    # a forward and backward of weight 0 that only keeps FSDP2's collectives in step (idle_micro_batch)
    idle: bool = False

    def of_policy_term(self, aggregation: str) -> float:
        """The share that weighs the policy (and in-loss KL) term under ``aggregation``."""
        return {"sequence_mean": self.responses, "constant": self.rows}.get(aggregation, self.tokens)


# Statistics averaged like the policy term (per response under sequence_mean); the others are
# token means.
POLICY_TERM_STATS = ("loss/policy_avg", "loss/kl_avg")


def minibatch_stats(parts: list[tuple[dict[str, Tensor], Share]], aggregation: str) -> dict[str, Tensor]:
    """A minibatch's statistics from its micro-batches': each weighted by the share its mean is
    of, so that they read as the unsplit minibatch's, however it was split."""
    weights = [
        {
            key: share.of_policy_term(aggregation) if key in POLICY_TERM_STATS else share.tokens
            for key in stats
        }
        for stats, share in parts
    ]
    return {
        key: torch.stack([stats[key] * w[key] for (stats, _), w in zip(parts, weights, strict=True)]).sum()
        for key in parts[0][0]
    }


def plan_micro_batches(
    minibatch: Experience, count: int, token_budget: int | None = None, sharded: bool = False
) -> list[tuple[Experience, Share]]:
    """The micro-batches of ``minibatch``, each trimmed, with their shares; its rows sorted by
    length, so that each micro-batch holds similar lengths: ``count`` of equal row counts (count >
    1), or runs of :func:`plan_row_groups` within ``token_budget`` (or with none, count 1: runs that
    leave out padding worth an extra forward). ``sharded`` (FSDP2), count 1 and no budget: the whole
    minibatch, trimmed, because FSDP2 accumulates micro-batches in whole unsharded fp32 gradients
    on every rank (docs/memory.md), a price for memory only a budget the user sets may ask."""
    if sharded and count == 1 and not token_budget:
        return [(minibatch.trimmed(), Share())]
    split = minibatch.input_ids.shape[1] - minibatch.response_ids.shape[1]
    lengths = minibatch.response_mask.sum(dim=1).float()
    # per row: its tokens, whether it has any, 1; a micro-batch's share is its part of their totals
    per_row = torch.stack([lengths, (lengths > 0).float(), torch.ones_like(lengths)])
    # the one host read of the plan: extents and the share counts of every row
    before, after, *counts = torch.cat([row_extents(minibatch.attention_mask, split), per_row]).tolist()
    if token_budget or count == 1:
        groups = plan_row_groups(before, after, budget=token_budget)
    else:
        groups = equal_groups(before, after, count)
    totals = [max(sum(c), 1.0) for c in counts]
    plan = []
    for group in groups:
        rows = group.rows.tolist()
        shares = (sum(c[i] for i in rows) / total for c, total in zip(counts, totals, strict=True))
        columns = group.columns(split)
        whole = len(groups) == 1  # one group of every row: no copy to select them
        micro = minibatch if whole else minibatch.select(group.rows.to(minibatch.input_ids.device))
        plan.append((micro.trimmed([columns.start, columns.stop - 1]), Share(*shares)))
    return plan


def idle_micro_batch(minibatch: Experience) -> tuple[Experience, Share]:
    """One row of ``minibatch`` cut to its last prompt column and first response column, of weight
    0: its forward and backward change no gradient and no statistic. Under FSDP2 every forward and
    backward gathers weights from every rank, so a rank whose plan has fewer micro-batches than
    another's runs these until the counts match. The row is the one with the longest response, so
    that its response column is a real token and every loss term is finite (0 x NaN would not be 0).
    """
    row = minibatch.response_mask.sum(dim=1).argmax().reshape(1)
    split = minibatch.input_ids.shape[1] - minibatch.response_ids.shape[1]
    one = minibatch.select(row)
    return one.trimmed([max(split - 1, 0), split]), Share(0.0, 0.0, 0.0, idle=True)
