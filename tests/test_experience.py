"""make_experience: where the score lands, the KL penalty, whitening, and the missing-EOS penalty."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo.config import PPOConfig
from lightning_ppo.ppo.experience import make_experience
from lightning_ppo.ppo.rollout_data import Rollout


def _rollout() -> Rollout:
    # Row 0 stops at index 1 (the stop token, id 1, also the pad id); row 1 never stops.
    return Rollout(
        prompt_ids=torch.tensor([[0, 5], [6, 7]]),
        prompt_mask=torch.tensor([[False, True], [True, True]]),
        response_ids=torch.tensor([[4, 1, 1], [4, 4, 4]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        ended=torch.tensor([True, False]),
    )


def _experience(**overrides):
    config = PPOConfig(whiten_advantages=False, gamma=1.0, gae_lambda=1.0, **overrides)
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, 9.0], [-1.0, -0.5, -1.0]])
    values = torch.zeros(2, 3)
    scores = torch.tensor([2.0, 3.0])
    return make_experience(_rollout(), logprobs, ref, values, scores, kl_coef=0.1, config=config)


def test_score_lands_on_last_real_token_and_kl_in_reward():
    exp = _experience()
    # row 0: kl = [0.5, 0, pad]; score 2 at index 1 (the stop token), never at the pad after it.
    assert exp.kl.tolist()[0] == pytest.approx([0.5, 0.0, 0.0])
    assert exp.rewards.tolist()[0] == pytest.approx([-0.05, 2.0, 0.0])
    # row 1 was truncated: its score lands on its last token.
    assert exp.rewards.tolist()[1] == pytest.approx([0.0, 0.05, 3.0])
    # gamma = lambda = 1, zero values: advantages are reward-to-go.
    assert exp.advantages.tolist()[0] == pytest.approx([1.95, 2.0, 0.0])
    assert exp.returns.tolist()[1] == pytest.approx([3.05, 3.05, 3.0])


def test_missing_eos_penalty_hits_only_unfinished_responses():
    exp = _experience(missing_eos_penalty=1.0)
    assert exp.scores.tolist() == pytest.approx([2.0, 2.0])


def test_k3_estimator_changes_the_penalty():
    exp = _experience(kl_estimator="k3")
    d = -0.5  # ref - logp on row 0, token 0
    assert exp.kl[0, 0].item() == pytest.approx(torch.tensor(d).exp().item() - 1 - d)


def test_whitened_advantages_have_zero_mean_unit_variance_over_real_tokens():
    config = PPOConfig(whiten_advantages=True)
    exp = make_experience(
        _rollout(),
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([1.0, -1.0]),
        0.1,
        config,
    )
    real = exp.advantages[exp.response_mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.var().item() == pytest.approx(1.0, abs=1e-4)
    assert exp.advantages[~exp.response_mask].abs().sum().item() == 0.0


def test_minibatches_partition_the_batch():
    exp = _experience()
    seen = torch.cat([mb.scores for mb in exp.minibatches(2, torch.Generator().manual_seed(0))])
    assert sorted(seen.tolist()) == sorted(exp.scores.tolist())


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="ppo.gamma"):
        PPOConfig(gamma=1.5)
    with pytest.raises(ValueError, match="ppo.clip_range"):
        PPOConfig(clip_range=0)
    with pytest.raises(ValueError, match="ppo.kl_estimator"):
        PPOConfig(kl_estimator="k7")
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(num_minibatches=3).check_batch_size(8)
