"""The statistics that warn judge every rank's answers, on 2 CPU ranks (gloo) through the CLI: the
logged ``diversity/*`` are the global batch's (not a mean of each rank's part), the same on both
ranks, and the guardrails see the same iteration on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from lightning_ppo.watch.diversity import Diversity
from lightning_ppo.watch.every_rank import BatchAnswers, prompt_key
from tests.helpers import quickstart_fit_args, ranks_process, two_cpu_ranks

NAMES = ("diversity/top_share", "diversity/distinct_1", "diversity/distinct_2", "diversity/overlap")


class AnswersRecorder(Callback):
    """Writes, per rank, each iteration's prompts, completions, logged diversity and the guardrails'
    first window to ``<out_dir>/answers<k>.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append(
            {
                "prompts": pl_module.last_samples.prompts,
                "completions": pl_module.last_samples.completions,
                "logged": {name: float(trainer.callback_metrics[name]) for name in NAMES},
                "early": pl_module.guardrails.early,
            }
        )
        Path(self.out_dir, f"answers{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def test_one_process_gathers_nothing_and_keys_prompts_by_identity():
    answers = BatchAnswers.gathered(None, ["1=", "2=", "1="], ["a", "b", "c"])
    assert answers.completions == ["a", "b", "c"]
    assert answers.prompts[0] == answers.prompts[2] != answers.prompts[1] == prompt_key("2=")
    assert len(prompt_key("x" * 10_000)) == 16  # what travels is short, whatever the prompt


@pytest.mark.ranks  # several processes: run alone (tests/conftest.py)
def test_diversity_and_the_guardrails_judge_both_ranks_answers(tiny_digits, tmp_path):
    recorder = {
        "class_path": "tests.test_every_rank.AnswersRecorder",
        "init_args": {"out_dir": str(tmp_path)},
    }
    args = quickstart_fit_args(tiny_digits, tmp_path, [recorder], *two_cpu_ranks("ddp", iterations=3))
    done = ranks_process(args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"answers{r}.json").read_text()) for r in (0, 1)]
    differs = False
    for row0, row1 in zip(*ranks, strict=True):
        together = Diversity.of(row0["prompts"] + row1["prompts"], row0["completions"] + row1["completions"])
        for name, value in together.metrics().items():
            assert row0["logged"][name] == row1["logged"][name] == pytest.approx(value, abs=1e-6), name
        parts = [Diversity.of(row["prompts"], row["completions"]).metrics() for row in (row0, row1)]
        differs |= any(
            abs((a[k] + b[k]) / 2 - together.metrics()[k]) > 1e-3 for a, b in [parts] for k in NAMES
        )
        assert row0["early"] == row1["early"]  # entropy and score over both ranks: one view of the run
    assert differs  # and it matters: the mean of each rank's own values is another number
