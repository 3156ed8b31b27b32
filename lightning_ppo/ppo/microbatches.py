"""The micro-batches of a minibatch, and the shares that make their gradients add up to its own.

A minibatch is split, its sequences sorted by length, into runs of similar lengths chosen to
leave out as much padding as an extra forward is worth (:mod:`lightning_ppo.ppo.row_groups`), whose
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
the same update as one unsplit pass, whatever the split. Under several ranks the shares are of
the global minibatch (:func:`over_every_rank`): the ranks' averaged gradients are then the mean
over every rank's tokens, as one process holding them all would compute it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from lightning_ppo.ppo.experience import Experience
from lightning_ppo.ppo.functional import Reduce
from lightning_ppo.ppo.row_groups import column_bounds, equal_groups, plan_row_groups


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


def weighted(term: Tensor, share: float | Tensor) -> Tensor:
    """``term * share``; a share of 1 (a minibatch in one pass) skips the multiplication, which
    would give ``term`` bit for bit and cost a kernel launch forward and another backward. A 0-d
    tensor share (compiled passes, lightning_ppo.ppo.compiled_loss) always multiplies: no branch on
    its value, which would compile a graph per value."""
    return term * share if isinstance(share, Tensor) or share != 1.0 else term


# Statistics averaged like the policy term (per response under sequence_mean); the others are
# token means.
POLICY_TERM_STATS = ("loss/policy_avg", "loss/kl_avg")


def minibatch_stats(parts: list[tuple[dict[str, Tensor], Share]], aggregation: str) -> dict[str, Tensor]:
    """A minibatch's statistics from its micro-batches': each weighted by the share its mean is
    of, so that they read as the unsplit minibatch's, however it was split."""
    if len(parts) == 1 and parts[0][1] == Share():
        return parts[0][0]  # the whole minibatch in one pass: its statistics are already its own
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


@dataclass(frozen=True)
class RowFacts:
    """What planning needs to know of every row of an experience, read to the host in one read:
    its first and last attended columns and its real response tokens (all (B,) int64 arrays)."""

    first: np.ndarray
    last: np.ndarray
    tokens: np.ndarray
    split: int  # the column where responses start
    length: int  # the experience's columns

    @classmethod
    def read(cls, exp: Experience) -> RowFacts:
        """The one host read (a sync on GPUs) of a PPO iteration's update."""
        split = exp.input_ids.shape[1] - exp.response_ids.shape[1]
        first, last = column_bounds(exp.attention_mask)
        first, last, tokens = np.array(torch.stack([first, last, exp.response_mask.sum(dim=1)]).tolist())
        return cls(first, last, tokens, split, exp.input_ids.shape[1])

    def extents(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each of ``rows``' real columns before the split and from it on (:func:`row_extents`)."""
        return self.split - self.first[rows], self.last[rows] + 1 - self.split

    def bounds(self, rows: np.ndarray) -> list[int]:
        """The first column any of ``rows`` attends to and the last (:meth:`Experience.padding_bounds`)."""
        return [int(self.first[rows].min(initial=self.length)), int(self.last[rows].max(initial=-1))]


@dataclass(frozen=True)
class MicroBatch:
    """A planned micro-batch: rows of the experience (in the order they run), the columns to keep
    (:meth:`Experience.trimmed`'s bounds) and its share of its minibatch."""

    rows: np.ndarray
    bounds: list[int]
    share: Share

    def of(self, exp: Experience, index: Tensor) -> Experience:
        """Its tensors, cut from ``exp`` by ``index`` (``rows`` on the experience's device)."""
        return exp.select(index).trimmed(self.bounds)


def plan_minibatch(
    facts: RowFacts, rows: np.ndarray, count: int, token_budget: int | None = None, sharded: bool = False
) -> list[MicroBatch]:
    """The micro-batches of the minibatch of ``rows`` (indices into the experience ``facts`` describe),
    planned on the host, with their shares; its rows sorted by length, so that each micro-batch
    holds similar lengths: ``count`` of equal row counts (count > 1), or runs of
    :func:`plan_row_groups` within ``token_budget`` (or with none, count 1: runs that leave out
    padding worth an extra forward). ``sharded`` (FSDP2), count 1 and no budget: the whole
    minibatch, trimmed, because FSDP2 accumulates micro-batches in whole unsharded fp32 gradients
    on every rank (docs/memory.md), a price for memory only a budget the user sets may ask."""
    if sharded and count == 1 and not token_budget:
        return [MicroBatch(rows, facts.bounds(rows), Share())]
    before, after = facts.extents(rows)
    if token_budget or count == 1:
        groups = plan_row_groups(before, after, budget=token_budget)
    else:
        groups = equal_groups(before, after, count)
    # per row: its tokens, whether it has any, 1; a micro-batch's share is its part of their totals
    tokens = facts.tokens[rows].astype(float)
    counts = [tokens, (tokens > 0).astype(float), np.ones_like(tokens)]
    totals = [max(float(c.sum()), 1.0) for c in counts]
    plan = []
    for group in groups:
        shares = (float(c[group.index].sum()) / total for c, total in zip(counts, totals, strict=True))
        columns = group.columns(facts.split)
        # one group of every row keeps the minibatch's own order (no sorting copy)
        picked = rows if len(groups) == 1 else rows[group.index]
        plan.append(MicroBatch(picked, [columns.start, columns.stop - 1], Share(*shares)))
    return plan


def over_every_rank(
    plan: list[list[MicroBatch]],
    facts: RowFacts,
    rows: list[np.ndarray],
    sum_over_ranks: Reduce | None,
    world: int,
    device: torch.device,
) -> list[list[MicroBatch]]:
    """``plan`` (each minibatch's micro-batches, ``rows`` of each) with shares of the global
    minibatch, every rank's part of it together, in place of shares of this rank's part.

    DDP (and FSDP2) average the ranks' gradients. With each rank's mean over its own tokens, that
    average weighs a token of a rank with few tokens more than one of a rank with many, and a rank
    whose samples were all dropped scales the step by (W - 1) / W. Scaled by ``world x`` this rank's
    count over the global count (one all-reduce of every minibatch's counts, for the whole update),
    the average is the global minibatch's own mean: the same update as one process holding every
    rank's rows (``token_mean`` over every token, ``sequence_mean`` over every response)."""
    if sum_over_ranks is None or world == 1:
        return plan
    local = torch.tensor(
        [[float(facts.tokens[r].sum()), float((facts.tokens[r] > 0).sum()), float(len(r))] for r in rows],
        dtype=torch.float64,
        device=device,
    )
    # each share was its group's count over max(local, 1): over max(global, 1), times world, instead
    scales = (world * local.clamp(min=1) / sum_over_ranks(local).clamp(min=1)).tolist()
    return [
        [replace(micro, share=_scaled(micro.share, scale)) for micro in minibatch]
        for minibatch, scale in zip(plan, scales, strict=True)
    ]


def _scaled(share: Share, scale: list[float]) -> Share:
    tokens, responses, rows = scale
    return Share(share.tokens * tokens, share.responses * responses, share.rows * rows, share.idle)


def plan_micro_batches(
    minibatch: Experience, count: int, token_budget: int | None = None, sharded: bool = False
) -> list[tuple[Experience, Share]]:
    """The micro-batches of ``minibatch``, each trimmed, with their shares (:func:`plan_minibatch`
    of its rows, after one host read)."""
    plan = plan_minibatch(RowFacts.read(minibatch), np.arange(len(minibatch)), count, token_budget, sharded)
    device = minibatch.input_ids.device
    return [(micro.of(minibatch, torch.as_tensor(micro.rows, device=device)), micro.share) for micro in plan]


def idle_micro_batch_plan(facts: RowFacts, rows: np.ndarray) -> MicroBatch:
    """One row of the minibatch of ``rows`` cut to its last prompt column and first response column,
    of weight 0: its forward and backward change no gradient and no statistic. Under FSDP2 every
    forward and backward gathers weights from every rank, so a rank whose plan has fewer
    micro-batches than another's runs these until the counts match. The row is the one with the
    longest response (the first of them), so that its response column is a real token and every
    loss term is finite (0 x NaN would not be 0)."""
    row = rows[int(np.argmax(facts.tokens[rows]))]
    split = facts.split
    return MicroBatch(np.array([row]), [max(split - 1, 0), split], Share(0.0, 0.0, 0.0, idle=True))


def idle_micro_batch(minibatch: Experience) -> tuple[Experience, Share]:
    """:func:`idle_micro_batch_plan` of ``minibatch``, cut from it."""
    micro = idle_micro_batch_plan(RowFacts.read(minibatch), np.arange(len(minibatch)))
    return micro.of(minibatch, torch.as_tensor(micro.rows, device=minibatch.input_ids.device)), micro.share


def cut_micro_batches(
    exp: Experience, plan: list[list[MicroBatch]]
) -> Iterator[list[tuple[Experience, Share]]]:
    """The tensors of each planned minibatch's micro-batches, cut from ``exp`` when it is its turn
    (so the copies of one minibatch live at a time); every row index crosses to the device in one
    copy for the whole plan."""
    flat = [micro for minibatch in plan for micro in minibatch]
    index = torch.from_numpy(np.concatenate([micro.rows for micro in flat]))
    parts = iter(index.to(exp.input_ids.device).split([len(micro.rows) for micro in flat]))
    for minibatch in plan:
        yield [(micro.of(exp, next(parts)), micro.share) for micro in minibatch]
