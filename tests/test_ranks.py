"""What steers training is decided from every rank's data, on 2 CPU ranks (gloo).

Whitening, REINFORCE++'s normalisation, the running score moments, the KL that drives the adaptive
controller and the decision to skip an iteration are all-reduced: every rank computes the same
numbers as one process holding the global batch would, and no rank skips (or waits) alone.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ppo.ppo import functional as F
from lightning_ppo.rewards import RunningMoments
from lightning_ppo.rollout.episodes import Environment, StepResult, Turn
from tests.helpers import free_port, quickstart_fit_args, ranks_process, spawn_forked, two_cpu_ranks

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)


WORLD = 2


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both ranks' data (rank r holds row r): tokens, their mask, and 3 batches of scores per rank,
    rank 1's second batch all non-finite (every score dropped)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(WORLD, 6, 10, generator=gen) + torch.tensor([[[-1.0]], [[2.0]]])  # rank means differ
    mask = torch.rand(WORLD, 6, 10, generator=gen) > 0.3
    scores = torch.rand(WORLD, 3, 5, generator=gen) * torch.tensor([[[1.0]], [[3.0]]])
    scores[1, 1] = float("nan")
    return x, mask, scores


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def _rank_statistics(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, mask, scores = _data()
        moments = RunningMoments()
        for batch in scores[rank]:
            moments.update(batch, _all_sum)
        result = {
            "whitened": F.masked_whiten(x[rank], mask[rank], reduce=_all_sum),
            "kept_shift": F.masked_whiten(x[rank], mask[rank], shift_mean=False, reduce=_all_sum),
            "moments": torch.tensor([moments.mean, moments.var, moments.count], dtype=torch.float64),
        }
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_whitening_and_score_moments_over_two_ranks_equal_one_process_over_the_global_batch(tmp_path):
    spawn_forked(_rank_statistics, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    x, mask, scores = _data()
    # One process with the global batch: the two ranks' rows stacked.
    whole = F.masked_whiten(x.reshape(-1, 10), mask.reshape(-1, 10))
    kept_shift = F.masked_whiten(x.reshape(-1, 10), mask.reshape(-1, 10), shift_mean=False)
    for rank in range(WORLD):
        torch.testing.assert_close(ranks[rank]["whitened"], whole.reshape(WORLD, 6, 10)[rank])
        torch.testing.assert_close(ranks[rank]["kept_shift"], kept_shift.reshape(WORLD, 6, 10)[rank])
        # and it matters: each rank's own statistics would give a different result
        assert not torch.allclose(ranks[rank]["whitened"], F.masked_whiten(x[rank], mask[rank]), atol=0.1)
    single = RunningMoments()
    for i in range(3):
        single.update(scores[:, i].reshape(-1))
    assert single.count == 25  # rank 1's second batch was all NaN
    torch.testing.assert_close(ranks[0]["moments"], ranks[1]["moments"], rtol=0, atol=0)
    expected = torch.tensor([single.mean, single.var, single.count], dtype=torch.float64)
    torch.testing.assert_close(ranks[0]["moments"], expected, rtol=1e-12, atol=1e-12)


def test_a_rank_whose_batch_is_all_dropped_does_not_hang_and_ranks_keep_one_controller(tiny_digits, tmp_path):
    """Rank 0's first batch scores NaN throughout (``on_bad_reward: drop``): before, rank 0 skipped the
    iteration alone and rank 1 waited forever in the gradient all-reduce. The adaptive KL
    controller and the score moments are also the same on both ranks after every iteration
    (measured before: kl_coef 0.043901 vs 0.046803 after 4 iterations)."""
    recorder = {"class_path": "tests.helpers.RankRecorder", "init_args": {"out_dir": str(tmp_path)}}
    reward = json.dumps({"class_path": "tests.helpers.NaNOnRankZeroAtFirst"})
    args = quickstart_fit_args(
        tiny_digits,
        tmp_path,
        [recorder],
        *two_cpu_ranks("ddp", iterations=3),
        *("--model.init_args.reward_fn", reward, "--model.init_args.ppo.on_bad_reward", "drop"),
        *("--model.init_args.ppo.kl_target", "1.0", "--model.init_args.ppo.kl_horizon", "100"),
        *("--model.init_args.ppo.score_norm", "true"),
    )
    done = ranks_process(args, timeout=240)  # a hang is a TimeoutExpired
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    for row0, row1 in zip(*ranks, strict=True):
        assert row0["checksum"] == row1["checksum"]
        assert row0["kl_coef"] == row1["kl_coef"]
        assert row0["score_moments"] == row1["score_moments"]
    # the first iteration learned from rank 1's 8 scores only; then 16 per iteration
    assert [row["score_moments"]["count"] for row in ranks[0]] == [8, 24, 40]
    assert ranks[0][0]["checksum"] != ranks[0][1]["checksum"]  # and it trained
    assert len({row["kl_coef"] for row in ranks[0]}) == 3  # the controller moved every iteration


def test_multi_turn_episodes_on_two_ddp_ranks_train_one_model(tiny_digits, tmp_path):
    """configs/agents.yaml on 2 ranks: each rank runs its own episodes (its own prompts and
    environment copies), the weights stay identical, and the episode metrics are every rank's."""
    recorder = {"class_path": "tests.helpers.RankRecorder", "init_args": {"out_dir": str(tmp_path)}}
    config = Path(__file__).resolve().parents[1] / "configs" / "agents.yaml"
    args = quickstart_fit_args(tiny_digits, tmp_path, [recorder], *two_cpu_ranks("ddp", 3), config=config)
    done = ranks_process(args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for row0, row1 in zip(*ranks, strict=True):
        assert row0["checksum"] == row1["checksum"]
        assert row0["episode_tokens"] == row1["episode_tokens"] > 6  # longer than one reply
        assert row0["completions"] != row1["completions"]
        assert all(" [env: " in text for text in row0["completions"])


class DropsOnRankZeroThenOnEvery(Environment):
    """One reply per episode. Every reset raises (dropped under ``episode.on_error: drop``) in rank
    0's first batch and in every rank's second (batches of 8, counted in the class: each episode runs
    on a copy)."""

    resets = itertools.count()

    def reset(self, prompt, row, rng) -> None:
        batch = next(DropsOnRankZeroThenOnEvery.resets) // 8
        if batch == 1 or (batch == 0 and dist.get_rank() == 0):
            raise ConnectionError("the sandbox is down")

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


def test_episodes_dropped_on_one_rank_or_on_every_rank_train_or_skip_together(tiny_digits, tmp_path):
    """Rank 0's first batch all dropped: both ranks train on rank 1's 8 episodes (before, rank 0's
    dropped episodes were scored and entered the score moments: 16). The second batch dropped on
    every rank: both skip it (before, both ran the update on empty masks and weight decay moved the
    weights), no rank waits for the other, and both train on the third."""
    recorder = {"class_path": "tests.helpers.RankRecorder", "init_args": {"out_dir": str(tmp_path)}}
    environment = json.dumps({"class_path": f"{__name__}.DropsOnRankZeroThenOnEvery"})
    args = quickstart_fit_args(
        tiny_digits,
        tmp_path,
        [recorder],
        *two_cpu_ranks("ddp", iterations=3),
        *("--model.init_args.environment", environment, "--model.init_args.episode.on_error", "drop"),
        *("--model.init_args.episode.max_tokens", "16", "--model.init_args.ppo.score_norm", "true"),
    )
    done = ranks_process(args, timeout=240)  # a hang is a TimeoutExpired
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for row0, row1 in zip(*ranks, strict=True):
        assert row0["checksum"] == row1["checksum"] and row0["score_moments"] == row1["score_moments"]
    assert [row["score_moments"]["count"] for row in ranks[0]] == [8, 8, 24]
    first, skipped, third = (row["checksum"] for row in ranks[0])
    assert first == skipped != third
