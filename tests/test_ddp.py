"""DDP on 2 CPU processes (gloo), through the real CLI: one model, different samples per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import forked_cli_process, quickstart_fit_args, ranks_process, two_cpu_ranks

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)


ROOT = Path(__file__).resolve().parents[1]


def test_ddp_two_processes_keep_weights_identical_and_sample_differently(tiny_digits, tmp_path):
    """As a user runs it: one command, and Lightning's launcher starts rank 1 (the other multi-rank
    tests start their ranks together, tests.helpers.start_ranks). Rank 0 is forked from the test
    zygote (the imports done), rank 1 a new interpreter Lightning's launcher starts."""
    recorder = {"class_path": "tests.helpers.RankRecorder", "init_args": {"out_dir": str(tmp_path)}}
    # 400 prompts: nothing below depends on which (40000, the config's, took ~2.5 s per rank to tokenize)
    args = quickstart_fit_args(tiny_digits, tmp_path, [recorder], *two_cpu_ranks("ddp"))
    done = forked_cli_process(args)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 2
    for row0, row1 in zip(*ranks, strict=True):
        assert row0["checksum"] == row1["checksum"]  # gradients were all-reduced: one model
        assert not set(row0["prompts"]) & set(row1["prompts"])  # each rank reads its own shard
        assert row0["completions"] != row1["completions"]
        assert row0["scores_logged"] == row1["scores_logged"]  # logged statistics are synced
    assert ranks[0][0]["checksum"] != ranks[0][1]["checksum"]  # and it did train


def test_ddp_ranks_with_different_micro_batch_counts_stay_one_model(tiny_digits, tmp_path):
    """A token budget splits each rank's minibatch by its own lengths: the ranks can run different
    numbers of micro-batches, and only the last of each syncs, so they must still agree."""
    recorder = {"class_path": "tests.helpers.RankRecorder", "init_args": {"out_dir": str(tmp_path)}}
    budget = ("--model.init_args.ppo.micro_batch_tokens", "48")
    args = quickstart_fit_args(
        tiny_digits, tmp_path, [recorder], *two_cpu_ranks("ddp"), *budget, prompts=40000
    )
    done = ranks_process(args)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for row0, row1 in zip(*ranks, strict=True):
        assert row0["checksum"] == row1["checksum"]
        assert row0["scores_logged"] == row1["scores_logged"]
    assert ranks[0][0]["checksum"] != ranks[0][1]["checksum"]
