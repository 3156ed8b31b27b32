"""Advantage estimators, dual clip and the KL controllers against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ppo.config import PPOConfig
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.experience import make_experience
from lightning_ppo.ppo.rollout_data import Rollout

# 2 prompts x 4 completions, each group contiguous
SCORES = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 6.0])


def test_grpo_group_advantages_hand_computed():
    adv = F.group_advantages(SCORES, 4, "grpo", eps=0.0)
    # group 1: mean 1, unbiased std sqrt((0 + 1 + 1 + 4) / 3) = sqrt(2)
    # group 2: mean 3, unbiased std sqrt((1 + 1 + 1 + 9) / 3) = 2
    s2 = math.sqrt(2.0)
    assert adv.tolist() == pytest.approx([0.0, -1 / s2, -1 / s2, 2 / s2, -0.5, -0.5, -0.5, 1.5])


def test_rloo_leave_one_out_hand_computed():
    adv = F.group_advantages(SCORES, 4, "rloo")
    # group 1: completion 0 earns 1 - mean(0, 0, 3) = 0, completion 3 earns 3 - mean(1, 0, 0) = 8/3;
    # group 2: 2 - mean(2, 2, 6) = -4/3 and 6 - mean(2, 2, 2) = 4
    assert adv.tolist() == pytest.approx([0.0, -4 / 3, -4 / 3, 8 / 3, -4 / 3, -4 / 3, -4 / 3, 4.0])
    assert adv.reshape(2, 4).sum(1).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)


def test_a_dropped_completion_leaves_its_groups_baseline():
    """Scores [1, 1, 0.8, NaN] with the NaN dropped: before, it counted as a score of 0 and the worst
    kept completion got +0.21 (reinforced). Without it: mean 14/15, unbiased std sqrt(1/75)."""
    scores = torch.tensor([1.0, 1.0, 0.8, 0.0, 0.0, 1.0, 0.0, 0.0])  # dropped rows hold 0
    valid = torch.tensor([True, True, True, False, True, True, False, False])
    grpo = F.group_advantages(scores, 4, "grpo", eps=0.0, valid=valid)
    mean, std = 14 / 15, math.sqrt(1 / 75)
    kept = [(1 - mean) / std, (1 - mean) / std, (0.8 - mean) / std]
    # group 2 has two valid completions (0 and 1): mean 0.5, std sqrt(0.5)
    assert grpo.tolist() == pytest.approx([*kept, 0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5), 0.0, 0.0])
    assert grpo[2] < 0  # the worst kept completion is discouraged
    rloo = F.group_advantages(scores, 4, "rloo", valid=valid)
    assert rloo.tolist() == pytest.approx([0.1, 0.1, -0.2, 0.0, -1.0, 1.0, 0.0, 0.0])
    # a group with one valid completion has no baseline: advantage 0
    lone = torch.tensor([True, False, False, False] * 2)
    assert F.group_advantages(scores, 4, "grpo", valid=lone).tolist() == [0.0] * 8


def test_dropped_rows_leave_the_group_baseline_in_make_experience():
    config = PPOConfig(advantage_estimator="grpo", num_generations=4, kl_placement="loss", kl_estimator="k3")
    rollout = _rollout(4)
    rollout.response_mask[3] = False  # how shape_scores marks a dropped sample
    zeros = torch.zeros(4, 2)
    exp = make_experience(rollout, zeros, zeros, zeros, torch.tensor([1.0, 1.0, 0.8, 0.0]), 0.1, config)
    assert exp.advantages[:, 0].tolist() == pytest.approx([0.577, 0.577, -1.155, 0.0], abs=1e-3)


def test_group_estimators_reject_groups_of_one():
    with pytest.raises(ValueError, match="num_generations >= 2"):
        F.group_advantages(SCORES, 1, "grpo")
    with pytest.raises(ValueError, match="ppo.num_generations"):
        PPOConfig(advantage_estimator="rloo", num_generations=1)


def test_discounted_returns_hand_computed_and_padding_free():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    returns = F.discounted_returns(rewards, mask, gamma=0.5)
    assert returns.tolist()[0] == pytest.approx([1.5, 1.0, 2.0, 0.0])


def _rollout(batch: int) -> Rollout:
    # responses of length 2 except the last one of each group (length 1)
    mask = torch.ones(batch, 2, dtype=torch.bool)
    mask[3::4, 1] = False
    return Rollout(
        prompt_ids=torch.zeros(batch, 1, dtype=torch.long),
        prompt_mask=torch.ones(batch, 1, dtype=torch.bool),
        response_ids=torch.ones(batch, 2, dtype=torch.long),
        response_mask=mask,
        ended=torch.ones(batch, dtype=torch.bool),
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_in_make_experience_broadcast_over_real_tokens(estimator):
    config = PPOConfig(
        advantage_estimator=estimator, num_generations=4, kl_placement="loss", kl_estimator="k3"
    )
    zeros = torch.zeros(8, 2)
    exp = make_experience(_rollout(8), zeros, zeros, zeros, SCORES, kl_coef=0.1, config=config)
    expected = F.group_advantages(SCORES, 4, estimator)
    assert torch.allclose(exp.advantages[:, 0], expected)
    assert torch.allclose(exp.advantages[:3, 1], expected[:3])
    assert exp.advantages[3, 1].item() == 0.0  # padding of the short response


def test_group_estimator_with_kl_in_reward_uses_the_penalised_return():
    config = PPOConfig(advantage_estimator="rloo", num_generations=4, kl_placement="reward")
    logprobs = torch.zeros(8, 2)
    ref = torch.zeros(8, 2)
    ref[0, 0] = -1.0  # sequence 0 has KL 1 (k1) on its first token
    exp = make_experience(_rollout(8), logprobs, ref, torch.zeros(8, 2), SCORES, kl_coef=0.5, config=config)
    penalised = SCORES.clone()
    penalised[0] -= 0.5
    assert torch.allclose(exp.advantages[:, 0], F.group_advantages(penalised, 4, "rloo"))


def test_reinforce_pp_normalises_reward_to_go_over_the_batch():
    config = PPOConfig(advantage_estimator="reinforce_pp", gamma=1.0, kl_coef=0.0)
    zeros = torch.zeros(8, 2)
    exp = make_experience(_rollout(8), zeros, zeros, zeros, SCORES, kl_coef=0.0, config=config)
    assert exp.returns[0].tolist() == pytest.approx([1.0, 1.0])  # score at the last token, reward-to-go
    real = exp.advantages[exp.response_mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.std().item() == pytest.approx(1.0, abs=1e-4)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[10.0, 10.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    plain = F.policy_loss(new, old, adv, mask, clip_range=0.2)
    dual = F.policy_loss(new, old, adv, mask, clip_range=0.2, dual_clip=3.0)
    # token 0: max(10, 1.2) = 10 without dual clip, min(10, 3) = 3 with it; token 1: max(-10, -1.2) = -1.2
    assert plain.loss.item() == pytest.approx((10.0 - 1.2) / 2)
    assert dual.loss.item() == pytest.approx((3.0 - 1.2) / 2)


def _estimated_kl_gradient(estimator: str, samples: int = 200_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of the sampled KL estimate in the loss, gradient of the exact KL(pi || ref)) for a
    5-token categorical policy, with the tokens sampled from the policy (as in a rollout)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8]), -1)
    logp = torch.log_softmax(logits, -1)
    tokens = torch.multinomial(logp.detach().exp(), samples, replacement=True, generator=gen)
    estimate = F.kl_penalty(logp[tokens], ref[tokens], estimator).mean()
    (grad,) = torch.autograd.grad(estimate, logits, retain_graph=True)
    (exact,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits)
    return grad, exact


def test_k1_in_the_loss_has_zero_expected_gradient_and_is_refused():
    k1, exact = _estimated_kl_gradient("k1")
    k2, _ = _estimated_kl_gradient("k2")
    assert k1.norm() < 0.02 * exact.norm()  # E[grad log pi] = 0: no pull toward the reference
    torch.testing.assert_close(k2, exact, rtol=0, atol=0.02 * exact.norm().item())  # k2's is the KL's
    with pytest.raises(ValueError, match=r"ppo.kl_estimator must be k2 or k3 with ppo.kl_placement 'loss'"):
        PPOConfig(kl_placement="loss", kl_estimator="k1")
