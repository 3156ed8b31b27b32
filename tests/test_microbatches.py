"""Micro-batches by count or by token budget give the unsplit minibatch's update."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.ppo.experience import Experience
from lightning_ppo.ppo.microbatches import (
    RowFacts,
    Share,
    idle_micro_batch,
    over_every_rank,
    plan_micro_batches,
    plan_minibatch,
)
from lightning_ppo.runs.errors import UsageError
from tests.helpers import CountCharReward, free_port, spawn_forked
from tests.test_trimming import _experience
from tests.tolerances import reordered_tolerance


def _gradient(module: PPOLightningModule, plan) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    for micro, share in plan:
        loss, _ = module.ppo_loss(micro, share)
        loss.backward()
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("split", ["count 3", "budget 40"])
def test_micro_batches_add_up_to_the_unsplit_minibatch(aggregation, split, tiny_gpt2):
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(loss_aggregation=aggregation, entropy_coef=0.01),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )
    exp = _experience(module)
    whole = _gradient(module, [(exp, Share())])
    kind, number = split.split()
    plan = plan_micro_batches(exp, 3) if kind == "count" else plan_micro_batches(exp, 1, int(number))
    assert len(plan) >= 3
    if kind == "budget":  # each rectangle within the budget, unless one sequence alone exceeds it
        assert all(m.input_ids.numel() <= 40 or len(m) == 1 for m, _ in plan)
        assert sum(m.input_ids.numel() for m, _ in plan) < exp.input_ids.numel()  # padding left out
    assert sum(share.tokens for _, share in plan) == pytest.approx(1.0)
    # float32 summation in other orders and shapes (measured below 1e-7 on this model)
    torch.testing.assert_close(_gradient(module, plan), whole, rtol=0, atol=reordered_tolerance(whole))


def test_the_token_budget_is_checked():
    with pytest.raises(UsageError, match="ppo.micro_batch_tokens must be >= 1 or null"):
        PPOConfig(micro_batch_tokens=0)


def test_idle_micro_batches_change_no_gradient(tiny_gpt2):
    """What an FSDP2 rank with fewer micro-batches than another runs to keep the collectives in step:
    one real token, weight 0, so the update is exactly the plan's own."""
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(entropy_coef=0.01, kl_placement="loss", kl_estimator="k3"),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )
    exp = _experience(module)
    plan = plan_micro_batches(exp, 1, 40)
    idle, share = idle_micro_batch(exp)
    assert idle.input_ids.shape == (1, 2) and idle.response_mask.all() and idle.attention_mask.all()
    assert share.idle and (share.tokens, share.responses, share.rows) == (0, 0, 0)
    padded = _gradient(module, plan + [(idle, share)] * 2)
    torch.testing.assert_close(padded, _gradient(module, plan), rtol=0, atol=0)


def test_a_whole_sharded_minibatch_is_trimmed_as_the_experience_trims_itself(tiny_gpt2):
    """FSDP2 without a budget runs each minibatch whole: its columns are planned on the host from the
    rows' read lengths, and must be those Experience.trimmed() reads from the device itself."""
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )
    exp = _experience(module)
    for minibatch in exp.minibatches(3, torch.Generator().manual_seed(0)):
        ((micro, share),) = plan_micro_batches(minibatch, 1, None, sharded=True)
        expected = minibatch.trimmed()
        assert share == Share() and micro.input_ids.shape == expected.input_ids.shape
        for field in fields(Experience):
            mine, theirs = getattr(micro, field.name), getattr(expected, field.name)
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), field.name


# ----------------------------------------------------------------- two ranks: the global mean
AGGREGATIONS = ("token_mean", "sequence_mean")


def _module(policy: str, aggregation: str) -> PPOLightningModule:
    torch.manual_seed(0)  # the critic's head: the same on every rank and in the one process
    return PPOLightningModule(
        policy=policy,
        reward_fn=CountCharReward(),
        ppo=PPOConfig(loss_aggregation=aggregation, entropy_coef=0.01),
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )


def _rank_gradients(
    rank: int, port: int, policy: str, folder: str, aggregations: Sequence[str] = AGGREGATIONS
) -> None:
    """Rank ``rank`` of 2 (gloo): its half of the rows (rank 0 the shortest responses), in two
    micro-batches, gradients averaged over the ranks as DDP averages them; with the shares of the
    global minibatch and, for comparison, of its own half."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        exp = torch.load(Path(folder) / "exp.pt", weights_only=False)
        mine = torch.argsort(exp.response_mask.sum(1), stable=True).chunk(2)[rank]
        part = exp.select(mine)
        facts, rows = RowFacts.read(part), [np.arange(len(part))]
        result = {}
        for aggregation in aggregations:
            module = _module(policy, aggregation)
            own = [plan_minibatch(facts, rows[0], 2)]
            for name, plan in (
                ("global", over_every_rank(own, facts, rows, _all_reduced, 2, torch.device("cpu"))),
                ("own", own),
            ):
                micro = [(m.of(part, torch.as_tensor(m.rows)), m.share) for m in plan[0]]
                result[f"{aggregation} {name}"] = _all_reduced(_gradient(module, micro)) / 2
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _all_reduced(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


@pytest.mark.ranks  # several processes: run alone (tests/conftest.py)
def test_two_ranks_with_uneven_lengths_step_as_one_process_on_the_whole_minibatch(tiny_gpt2, tmp_path):
    """Before, each rank divided by its own token (response) count and DDP averaged the ranks: a token
    of the rank with short responses (and fewer, some dropped) weighed more than one of the other's."""
    exp = _experience(_module(str(tiny_gpt2), "token_mean"))
    shortest = torch.argsort(exp.response_mask.sum(1), stable=True)
    exp.response_mask[shortest[:3]] = False  # dropped samples (on_bad_reward: drop), all on rank 0
    lengths = exp.response_mask.sum(1)[shortest]
    assert lengths[:8].sum() < lengths[8:].sum()  # uneven: rank 0 holds the short responses
    torch.save(exp, tmp_path / "exp.pt")
    spawn_forked(_rank_gradients, args=(free_port(), str(tiny_gpt2), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for aggregation in AGGREGATIONS:
        whole = _gradient(_module(str(tiny_gpt2), aggregation), [(exp, Share())])
        tolerance = reordered_tolerance(whole)
        for rank in ranks:
            torch.testing.assert_close(rank[f"{aggregation} global"], whole, rtol=0, atol=tolerance)
        gap = (ranks[0][f"{aggregation} own"] - whole).abs().max()
        assert gap > 100 * tolerance, aggregation  # and it matters: each rank's own mean is another step


@pytest.mark.ranks  # several processes: run alone (tests/conftest.py)
def test_a_rank_whose_samples_were_all_dropped_does_not_scale_the_step(tiny_gpt2, tmp_path):
    """Every sample of rank 0 dropped (on_bad_reward: drop): the step is one process's on the whole
    batch, i.e. on rank 1's samples alone. With each rank's own mean, rank 0's zero gradient entered
    DDP's average and scaled the step by (W - 1) / W = 1/2."""
    exp = _experience(_module(str(tiny_gpt2), "token_mean"))
    shortest = torch.argsort(exp.response_mask.sum(1), stable=True)
    assert exp.response_mask[shortest[8]].any()  # so the 8 emptied rows are exactly rank 0's half
    exp.response_mask[shortest[:8]] = False
    torch.save(exp, tmp_path / "exp.pt")
    aggregations = [*AGGREGATIONS, "constant"]
    spawn_forked(_rank_gradients, args=(free_port(), str(tiny_gpt2), str(tmp_path), aggregations), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for aggregation in aggregations:
        whole = _gradient(_module(str(tiny_gpt2), aggregation), [(exp, Share())])
        tolerance = reordered_tolerance(whole)
        assert whole.abs().max() > 100 * tolerance  # rank 1's samples do move the weights
        for rank in ranks:
            torch.testing.assert_close(rank[f"{aggregation} global"], whole, rtol=0, atol=tolerance)
        own = ranks[0][f"{aggregation} own"]
        if aggregation == "constant":  # its policy term divides by rows, dropped or not; the
            # critic's and the entropy's token means are halved all the same
            assert (own - whole).abs().max() > 100 * tolerance
        else:  # every term a token (response) mean: per rank, the whole step halved
            torch.testing.assert_close(own, whole / 2, rtol=0, atol=tolerance)
