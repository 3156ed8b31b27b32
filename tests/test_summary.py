"""The run summary's first, best and last windows, and the smoothed score a best checkpoint is chosen on."""

from __future__ import annotations

import pytest

from lightning_ppo.callbacks import summarise
from lightning_ppo.watch.metrics import TrailingMean


def test_the_summary_reports_the_best_window_a_run_lost_again():
    # 20 iterations: windows of 2. The run peaks at iterations 9-10 and falls back.
    scores = [0.1, 0.3] + [0.4] * 6 + [0.9, 0.7] + [0.5] * 8 + [0.2, 0.4]
    summary = summarise(scores, final_kl=3.5, wall_seconds=12.0)
    assert summary.start_score == pytest.approx(0.1)
    assert summary.first_score == pytest.approx(0.2)
    assert summary.best_score == pytest.approx(0.8)
    assert summary.best_window == (9, 10)
    assert summary.last_score == pytest.approx(0.3)
    assert str(summary) == (
        "20 PPO iterations in 12 s: mean score 0.100 (iteration 1), 0.200 (first 10 %), "
        "0.800 (best 10 %, iterations 9-10), 0.300 (last 10 %); final KL 3.500"
    )


def test_the_summary_of_a_run_shorter_than_ten_iterations_uses_windows_of_one():
    summary = summarise([0.2, 0.6, 0.4], final_kl=0.0, wall_seconds=1.0)
    assert (summary.first_score, summary.best_score, summary.best_window, summary.last_score) == (
        0.2,
        0.6,
        (2, 2),
        0.4,
    )


def test_the_smoothed_score_is_the_mean_of_the_last_window_and_survives_a_checkpoint():
    smoothed = TrailingMean(window=3)
    assert [smoothed.add(v) for v in (3.0, 0.0, 6.0, 9.0)] == pytest.approx([3.0, 1.5, 3.0, 5.0])
    resumed = TrailingMean(window=3)
    resumed.load_state_dict(smoothed.state_dict())
    assert resumed.add(0.0) == smoothed.add(0.0) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        TrailingMean(window=0)
