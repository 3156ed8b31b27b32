"""Each logged rollout statistic against a hand-computed value; padding must not count."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ppo.ppo.experience import Experience
from lightning_ppo.watch.metrics import HOST_STATS, OVER_RANKS, HostView, experience_metrics, score_metrics


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


def test_the_host_view_logs_every_statistic_averaged_over_ranks_in_one_reduce_and_decides_on_its_own():
    """One collective for every logged value (a stand-in for the strategy's mean: two ranks, the other
    rank's values 1 higher); statistics computed over every rank already are logged as they are, and
    what the host decides on stays this rank's."""
    stats = {name: torch.tensor(float(i)) for i, name in enumerate(HOST_STATS)}
    stats["returns/mean"] = torch.tensor(0.25)
    calls = []

    def mean(x):
        calls.append(x.clone())
        return (x + (x + 1)) / 2

    host = HostView.read(
        stats,
        torch.tensor([True, False]),
        torch.tensor([1.0, 3.0]),
        torch.tensor([0.5, 0.0]),
        torch.tensor([1.0, 3.0]),
        torch.tensor([True, True]),
        mean,
    )
    assert len(calls) == 1 and len(calls[0]) == sum(name not in OVER_RANKS for name in stats)
    assert list(host.logged) == list(stats)  # in the order they were computed
    for i, name in enumerate(HOST_STATS):
        assert host.stats[name] == float(i)
        assert host.logged[name] == (float(i) if name in OVER_RANKS else i + 0.5)
    assert host.logged["returns/mean"] == 0.75
    assert host.stepped == [True, False] and host.scores == [1.0, 3.0] and host.kl == [0.5, 0.0]
    assert host.scores_std == 1.0
    alone = HostView.read(stats, torch.tensor([True]), *[torch.tensor([2.0])] * 3, torch.tensor([True]))
    assert alone.logged == {name: float(value) for name, value in stats.items()} and alone.scores_std is None


def test_the_spread_the_guardrails_judge_is_every_ranks():
    """One kept score per rank, on two ranks holding the same batch (``total`` stands for the sum over
    them): the spread is judged over both ranks' two scores (0.0), not on this rank's one (None)."""
    from lightning_ppo.watch.metrics import HOST_STATS, HostView

    stats = {name: torch.tensor(0.0) for name in HOST_STATS}
    used, kept = torch.tensor([1.0]), torch.tensor([True])
    alone = HostView.read(stats, torch.tensor([True]), used, used, used, kept)
    both = HostView.read(stats, torch.tensor([True]), used, used, used, kept, None, lambda t: t * 2)
    assert alone.scores_std is None and both.scores_std == 0.0


def test_the_export_dtype_is_the_one_most_trained_values_are_in():
    from lightning_ppo.export import trained_dtype

    bf16_run = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "bias": torch.zeros(4, dtype=torch.float32)}
    assert trained_dtype(bf16_run) == torch.bfloat16  # not fp32 for one small buffer kept in fp32
    assert trained_dtype({"w": torch.zeros(4), "step": torch.tensor(3)}) == torch.float32


def test_an_accuracy_column_that_is_not_numbers_is_one_line():
    from lightning_ppo.runs.errors import UsageError
    from lightning_ppo.scoring import answer_accuracy

    assert answer_accuracy([1.0, 0.0, True, 0], 4) == 0.5
    with pytest.raises(UsageError, match="'correct' holds \\['yes', 'no'\\]"):
        answer_accuracy(["yes", "no"], 2)
