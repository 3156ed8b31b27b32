"""Generation ahead of training (``ppo.max_staleness``, lightning_ppo.rollout.ahead) with the ``hf``
engine: a background thread samples from a snapshot of the policy while the update runs. The same
loop through a vLLM server is tested in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.ppo import functional as F
from lightning_ppo.rollout.ahead import check_ahead, pending_of_rank
from lightning_ppo.rollout.episodes import Environment, StepResult, Turn
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import cli_process, quiet_trainer, start_cli

ROOT = Path(__file__).resolve().parents[1]


class Record(pl.Callback):
    """(iteration, logged staleness, engine/logp_abs_diff) of every iteration that trained."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float]] = []
        self.pending_at_end = -1

    def on_train_end(self, trainer, module) -> None:
        self.pending_at_end = len(module._ahead.pending())

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if self.rows and self.rows[-1][0] == module.iteration or module.iteration == 0:
            return
        metrics = trainer.callback_metrics
        self.rows.append(
            (module.iteration, float(metrics["async/staleness"]), float(metrics["engine/logp_abs_diff"]))
        )


def _module(policy: Path, staleness: int, **settings) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        ppo=PPOConfig(max_staleness=staleness),
        generation=GenerationConfig(max_new_tokens=8, stop_token="="),
        **settings,
    )


@pytest.mark.parametrize("staleness", [1, 2])
def test_no_rollout_older_than_the_bound_is_trained(staleness, tiny_digits, tmp_path):
    """6 batches: the first ``staleness`` steps only start sampling; every rollout trained after is
    exactly ``staleness`` updates old (the first, sampled before any update, 0); the behaviour
    log-probs are the snapshot's, off the trainer's once the policy moved, and the last batches
    stay pending."""
    pl.seed_everything(0)
    module, record = _module(tiny_digits, staleness), Record()
    quiet_trainer(tmp_path, iterations=6, callbacks=[record]).fit(
        module, DigitsDataModule(num_prompts=6 * 16, batch_size=16, max_prompt_length=16)
    )
    iterations = [row[0] for row in record.rows]
    assert iterations == list(range(1, 7 - staleness))
    stale = [row[1] for row in record.rows]
    assert stale == [min(i, staleness) for i in range(len(stale))]
    assert record.rows[0][2] < 1e-5  # the first rollout's snapshot is the policy that trains on it
    assert all(row[2] > 1e-4 for row in record.rows[staleness:])  # later: sampled by older weights
    assert record.pending_at_end == staleness
    assert module._ahead is None  # closed at the end of fit: a new fit starts afresh


def test_the_decoupled_loss_against_hand_numbers():
    """Two tokens, advantage 1: ratio against the trainer's (proximal) log-probs, each token's loss
    weighted by min(exp(proximal - behaviour), C)."""
    new = torch.tensor([[-1.0, -2.0]])
    proximal = torch.tensor([[-1.2, -2.0]])
    behaviour = torch.tensor([[-2.0, -0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = F.truncated_is_weights(proximal, behaviour, mask, "token", 2.0)
    assert weights[0].tolist() == pytest.approx([2.0, float(torch.tensor(-1.5).exp())])  # e^0.8 > 2: cut
    out = F.policy_loss(new, proximal, torch.ones(1, 2), mask, clip_range=0.2, is_weights=weights)
    # token 1: r = e^0.2 = 1.2214 > 1.2, clipped to 1.2: -1.2 x 2.0; token 2: r = 1: -1 x e^-1.5
    expected = (-1.2 * 2.0 - float(torch.tensor(-1.5).exp())) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


class Nudge(Environment):
    """Three turns, the same short observation between them."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="0=", done=turn.index >= 2)


def test_multi_turn_episodes_are_sampled_ahead(tiny_digits, tmp_path):
    pl.seed_everything(0)
    module, record = (
        _module(tiny_digits, 1, environment=Nudge(), episode=EpisodeConfig(max_turns=3, max_tokens=20)),
        Record(),
    )
    quiet_trainer(tmp_path, iterations=4, callbacks=[record]).fit(
        module, DigitsDataModule(num_prompts=4 * 16, batch_size=16, max_prompt_length=16)
    )
    assert [row[1] for row in record.rows] == [0.0, 1.0, 1.0]
    # the stats logged are the trained batch's episodes: three turns each, as this environment says
    assert module.episode_runner.last_stats is not None
    assert all(t.count("0=") >= 1 for t in module.episode_runner.transcripts)


def test_staleness_0_samples_on_the_main_thread_as_before(tiny_digits, tmp_path):
    """The default runs no background thread and keeps no pending batches in its checkpoints."""
    module = _module(tiny_digits, 0)
    quiet_trainer(tmp_path, iterations=2).fit(
        module, DigitsDataModule(num_prompts=32, batch_size=16, max_prompt_length=16)
    )
    assert module._ahead is None and module.iteration == 2
    checkpoint: dict = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    assert "lightning_ppo_pending" not in checkpoint


@pytest.mark.parametrize(
    ("engine", "staleness", "settings", "says"),
    [
        ("vllm", 1, {}, "needs generation.engine 'hf' or 'vllm_server'"),
        ("vllm_server", 2, {"server_urls": ["http://h:1"]}, "at most 1"),
        ("vllm_server", 1, {"server_urls": ["http://h:1"], "top_p": 0.9}, "top_k 0 and top_p 1.0"),
    ],
)
def test_what_cannot_sample_ahead_is_refused(engine, staleness, settings, says):
    with pytest.raises(UsageError, match=says):
        check_ahead(staleness, GenerationConfig(engine=engine, **settings), model_parallel=False)
    with pytest.raises(UsageError, match="cannot run under FSDP2"):
        check_ahead(1, GenerationConfig(), model_parallel=True)


def test_pending_batches_of_another_number_of_ranks_are_refused():
    class Two:
        world_size, global_rank = 2, 0

    with pytest.raises(UsageError, match="sampled ahead by 1 ranks.*resume with 1 ranks"):
        pending_of_rank([["a batch"]], Two(), 1)


def _fit_args(policy: Path, root: Path, log: Path, batches: int) -> list[str]:
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "save_top_k": -1, "dirpath": str(root / "ckpt")},
    }
    recorder = {"class_path": "tests.helpers.TrainedPromptLog", "init_args": {"path": str(log)}}
    return [
        *(
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--model.init_args.policy",
            str(policy),
        ),
        *("--model.init_args.ppo.max_staleness", "1", "--trainer.limit_train_batches", str(batches)),
        *("--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root)),
        *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.callbacks", json.dumps([recorder, saver])),
    ]


def _trained(log: Path) -> list[tuple[int, str]]:
    return [
        (int(i), p) for i, p in (line.rstrip("\n").split("\t", 1) for line in log.read_text().splitlines())
    ]


def test_every_prompt_is_trained_exactly_once_across_sigkills_and_resumes(tiny_digits, tmp_path):
    """The quickstart with staleness 1, 10 batches: killed (SIGKILL) after the checkpoints of
    iterations 3 and 6 and resumed with ``--ckpt_path last`` each time; the prompts trained, counted
    by the iterations the checkpoints kept, are the uninterrupted run's multiset."""
    whole_log = tmp_path / "whole.log"
    run = cli_process(_fit_args(tiny_digits, tmp_path / "whole", whole_log, 10))
    assert run.returncode == 0, run.stderr[-3000:]
    whole = _trained(whole_log)
    assert [i for i, _ in whole][::64] == list(range(1, 10))  # 9 trained, the 10th batch pending

    root, log, kept = tmp_path / "stopped", tmp_path / "stopped.log", []
    for kill_after in (3, 6, None):
        args = _fit_args(tiny_digits, root, log, 10) + (
            ["--ckpt_path", "last"] if kept or log.exists() else []
        )
        process = start_cli(args)
        if kill_after is None:
            assert process.wait(timeout=300) == 0
        else:
            deadline = time.monotonic() + 300
            while not (root / "ckpt" / f"iteration={kill_after}.ckpt").exists():
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=60)
        lines = _trained(log)
        log.unlink()
        kept.append(lines)
    # each resumed run starts after the checkpoint it loaded: what the killed run trained past it is dropped
    counted = []
    for lines, after in zip(kept, kept[1:] + [None], strict=True):
        resumed_from = after[0][0] if after else None
        counted += [(i, p) for i, p in lines if resumed_from is None or i < resumed_from]
    assert Counter(p for _, p in counted) == Counter(p for _, p in whole)
    assert sorted({i for i, _ in counted}) == list(range(1, 10))


def test_the_quickstart_learns_as_well_one_step_off(tiny_digits, tmp_path):
    """The quickstart run of tests/test_learning.py (GAE, kl_coef 0.02) against the same run with
    staleness 1 (61 batches: 60 trained): the score rises by the same bounds, and ends within the
    spread of synchronous runs over seeds. Measured, last-10 % score, seeds 0-3: synchronous 0.870,
    0.873, 0.560, 0.663; one step off 0.760, 0.722, 0.555, 0.602 (0.08 lower on average: each
    update learns from data one update old)."""
    from tests.test_learning import _fit

    _, synchronous = _fit(
        "quickstart.yaml", tiny_digits, tmp_path / "sync", 60, "--model.init_args.ppo.kl_coef", "0.02"
    )
    cli, ahead = _fit(
        "quickstart.yaml",
        tiny_digits,
        tmp_path / "ahead",
        61,
        *("--model.init_args.ppo.kl_coef", "0.02", "--model.init_args.ppo.max_staleness", "1"),
    )
    assert ahead.iterations == 60
    assert cli.model.guardrails.fired == set()
    assert ahead.first_score < 0.4
    assert ahead.last_score > ahead.first_score + 0.15
    assert ahead.last_score > synchronous.last_score - 0.2, (ahead.last_score, synchronous.last_score)
    assert ahead.final_kl < 20.0


@pytest.mark.ranks
def test_two_ranks_sample_ahead_and_train_the_same_steps(tiny_digits, tmp_path):
    """DDP on 2 CPU ranks, staleness 1: both ranks only start sampling at the first step and train
    every later one together (the gradients' all-reduce would hang otherwise); the checkpoint keeps
    each rank's pending batch, and the resumed run trains them first, in its next epoch."""
    root = tmp_path / "run"
    args = _fit_args(tiny_digits, root, tmp_path / "log", 4) + [
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
    ]
    run = cli_process(args)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = _trained(tmp_path / "log")  # rank 0's: 3 iterations of its 64 prompts
    assert sorted({i for i, _ in lines}) == [1, 2, 3]
    pending = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)["lightning_ppo_pending"]
    assert [len(rank) for rank in pending] == [1, 1]
    assert pending[0][0]["prompts"] != pending[1][0]["prompts"]  # each rank's own batch
    # The epoch that run cut short counts as finished: one batch of a second epoch trains the pending first.
    resumed_args = _fit_args(tiny_digits, root, tmp_path / "log2", 1) + ["--trainer.max_epochs", "2"]
    resumed = cli_process(
        resumed_args + ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--ckpt_path", "last"]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank, log in enumerate([tmp_path / "log2", tmp_path / "log2.1"]):
        assert [p for i, p in _trained(log) if i == 4] == pending[rank][0]["prompts"]


def test_a_batch_whose_sampling_failed_stays_pending():
    """The background job raised (a server died): the error reaches the training step, and the batch
    is still among those a checkpoint would keep."""
    from lightning_ppo.rollout.ahead import RolloutsAhead

    def prepare(batch, position):
        def sample():
            raise ConnectionError("the server went away")

        return sample

    ahead = RolloutsAhead(1, prepare)
    try:
        assert ahead.next("batch 0", 0) is None
        with pytest.raises(ConnectionError, match="went away"):
            ahead.next("batch 1", 0)
        assert sorted(ahead.pending()) == ["batch 0", "batch 1"]
    finally:
        ahead.close()
