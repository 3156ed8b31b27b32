"""Each logged rollout statistic against a hand-computed value; padding must not count."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ppo.experience import Experience
from lightning_ppo.metrics import experience_metrics, score_metrics


def _experience() -> Experience:
    # Row 0: 2 real tokens then padding holding garbage; row 1: 3 real tokens.
    mask = torch.tensor([[True, True, False], [True, True, True]])
    filled = torch.zeros(2, 3)
    return Experience(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.bool),
        position_ids=torch.zeros(2, 4, dtype=torch.long),
        response_ids=torch.zeros(2, 3, dtype=torch.long),
        response_mask=mask,
        logprobs=filled,
        ref_logprobs=filled,
        values=torch.tensor([[1.0, 2.0, 99.0], [0.0, 1.0, 2.0]]),
        scores=torch.tensor([1.0, 3.0]),
        kl=torch.tensor([[0.5, 0.25, 0.0], [0.1, 0.2, 0.3]]),
        rewards=filled,
        advantages=torch.tensor([[1.0, -1.0, 50.0], [2.0, 0.0, 1.0]]),
        returns=torch.tensor([[2.0, 1.0, 70.0], [1.0, 1.0, 4.0]]),
    )


def test_rollout_metrics_hand_computed_padding_excluded():
    exp = _experience()
    entropy = torch.tensor([[1.0, 2.0, 100.0], [0.5, 0.5, 0.5]])  # 100 sits on padding
    ended = torch.tensor([True, False])
    m = {
        k: v.item() for k, v in experience_metrics(exp, entropy, ended, kl_coef=0.1, with_critic=True).items()
    }
    assert m["objective/kl"] == pytest.approx((0.75 + 0.6) / 2)
    assert m["objective/entropy"] == pytest.approx((3.0 + 1.5) / 2)
    assert m["objective/non_score_reward"] == pytest.approx(-0.1 * (0.75 + 0.6) / 2)
    assert m["objective/rlhf_reward"] == pytest.approx((1.0 - 0.075 + 3.0 - 0.06) / 2)
    # real returns: 2, 1, 1, 1, 4 -> mean 1.8, unbiased std sqrt(((.2)^2 + 3 (.8)^2 + 2.2^2) / 4)
    assert m["returns/mean"] == pytest.approx(1.8)
    assert m["returns/std"] == pytest.approx(math.sqrt((0.04 + 3 * 0.64 + 4.84) / 4))
    assert m["advantages/mean"] == pytest.approx((1.0 - 1.0 + 2.0 + 0.0 + 1.0) / 5)
    assert m["response/length_mean"] == pytest.approx(2.5)
    assert m["response/eos_fraction"] == pytest.approx(0.5)
    # residuals returns - values on real tokens: 1, -1, 1, 0, 2
    residual = torch.tensor([1.0, -1.0, 1.0, 0.0, 2.0])
    real_returns = torch.tensor([2.0, 1.0, 1.0, 1.0, 4.0])
    expected_ev = 1 - residual.var(unbiased=False) / real_returns.var(unbiased=False)
    assert m["val/explained_variance"] == pytest.approx(expected_ev.item())


def test_critic_free_runs_report_no_explained_variance():
    exp = _experience()
    metrics = experience_metrics(
        exp, torch.zeros(2, 3), torch.ones(2, dtype=torch.bool), 0.1, with_critic=False
    )
    assert "val/explained_variance" not in metrics


def test_score_metrics_report_the_raw_scores_of_the_kept_samples():
    raw = torch.tensor([1.0, 3.0, float("nan"), 5.0])
    shaped = torch.tensor([-1.0, 0.0, 0.0, 1.0])
    dropped = torch.tensor([False, False, True, False])
    m = {k: v.item() for k, v in score_metrics(raw, shaped, dropped, shaping=True).items()}
    assert m["objective/scores"] == pytest.approx(3.0)
    assert m["objective/scores_std"] == pytest.approx(math.sqrt(8 / 3))
    assert m["objective/scores_normalized"] == pytest.approx(0.0)
    assert m["reward/dropped"] == 1.0
    assert "objective/scores_normalized" not in score_metrics(raw, shaped, dropped, shaping=False)
