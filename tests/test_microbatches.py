"""Micro-batches by count or by token budget give the unsplit minibatch's update."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.ppo.experience import Experience
from lightning_ppo.ppo.microbatches import Share, idle_micro_batch, plan_micro_batches
from lightning_ppo.runs.errors import UsageError
from tests.helpers import CountCharReward
from tests.test_trimming import _experience

# float32 summation in other orders and shapes (measured below 1e-7 on this model)
TOLERANCE = 1e-5


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
    torch.testing.assert_close(_gradient(module, plan), whole, rtol=0, atol=TOLERANCE)


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
