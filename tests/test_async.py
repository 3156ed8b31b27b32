"""Generation ahead of training (``ppo.max_staleness``, lightning_ppo.rollout.ahead) with the ``hf``
engine: a background thread samples from a snapshot of the policy while the update runs. The same
loop through a vLLM server is tested in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import signal
import threading
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
from tests.helpers import StartedRanks, forked_cli_process, quiet_trainer, ranks_process, start_forked
from tests.test_learning import SHARED_RUN, _fit, quickstart_run

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


class HaltUntilKilled(pl.Callback):
    """Halts the run at a point fixed in advance until the test kills it: as the step after
    ``iteration`` starts (its checkpoint saved, the next batch sampled ahead and pending), or, not
    ``checkpointed``, as ``iteration`` ends (its prompts logged: TrainedPromptLog comes first, and
    Lightning runs checkpoint callbacks last). It writes ``path`` and waits there, so the test's
    SIGKILL lands at that point however loaded the machine, not wherever the run had got to by the
    time the test saw a checkpoint."""

    def __init__(self, iteration: int, checkpointed: bool, path: str) -> None:
        self.iteration, self.checkpointed, self.path = iteration, checkpointed, path

    def on_train_batch_start(self, trainer, module, *args) -> None:
        if self.checkpointed and module.iteration == self.iteration:
            self._halt()

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if not self.checkpointed and module.iteration == self.iteration and module.last_samples is not None:
            self._halt()

    def _halt(self) -> None:
        Path(self.path).write_text("halted\n")
        threading.Event().wait(600)  # the kill comes first; a test that died leaves no run behind for long
        raise RuntimeError(f"halted at iteration {self.iteration} and not killed within 600 s")


BATCH = 16


def _fit_args(policy: Path, root: Path, log: Path, batches: int, halt: dict | None = None) -> list[str]:
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "save_top_k": -1, "dirpath": str(root / "ckpt")},
    }
    recorder = {"class_path": "tests.helpers.TrainedPromptLog", "init_args": {"path": str(log)}}
    halting = [{"class_path": "tests.test_async.HaltUntilKilled", "init_args": halt}] if halt else []
    return [
        *(
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--model.init_args.policy",
            str(policy),
        ),
        *("--model.init_args.ppo.max_staleness", "1", "--trainer.limit_train_batches", str(batches)),
        # a quarter of the config's batch and 400 prompts: what the kills and resumes do to the data
        # does not depend on its size, and each of the four runs costs a third as much; nor on how
        # many passes an update makes over its batch (one, not the config's 4)
        *("--data.init_args.batch_size", str(BATCH), "--data.init_args.num_prompts", "400"),
        *("--model.init_args.ppo.ppo_epochs", "1"),
        *("--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root)),
        *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.callbacks", json.dumps([recorder, *halting, saver])),
    ]


def _trained(log: Path) -> list[tuple[int, str]]:
    return [
        (int(i), p) for i, p in (line.rstrip("\n").split("\t", 1) for line in log.read_text().splitlines())
    ]


def _halted(marker: Path, process) -> None:
    """Once the run has written ``marker`` (HaltUntilKilled), where it waits to be killed."""
    deadline = time.monotonic() + 600  # a guard: the run gets there in seconds (90 s at a load of 16)
    while not marker.exists():
        assert process.poll() is None, "the run ended before it halted"
        assert time.monotonic() < deadline, "the run did not halt within 600 s"
        time.sleep(0.05)  # polls a file another process writes; the run waits there for the kill


def test_every_prompt_is_trained_exactly_once_across_sigkills_and_resumes(tiny_digits, tmp_path):
    """The quickstart with staleness 1, 10 batches: killed (SIGKILL) just after the checkpoint of
    iteration 3, its next batch sampled ahead and pending, and resumed with ``--ckpt_path
    last``; killed again once iteration 7 trained and logged its prompts, before its checkpoint (the
    resumed run trains it again); resumed again to the end. The prompts trained, counted by the
    iterations the checkpoints kept, are the uninterrupted run's multiset. Each run halts where it
    is killed (HaltUntilKilled): the kills land at those points whatever the machine's load."""
    whole_log = tmp_path / "whole.log"
    run = forked_cli_process(_fit_args(tiny_digits, tmp_path / "whole", whole_log, 10), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    whole = _trained(whole_log)
    assert [i for i, _ in whole][::BATCH] == list(range(1, 10))  # 9 trained, the 10th batch pending

    root, log, kept = tmp_path / "stopped", tmp_path / "stopped.log", []
    for index, (iteration, checkpointed) in enumerate([(3, True), (7, False), (None, None)]):
        marker = tmp_path / f"halted{index}"
        halt = None if iteration is None else {"iteration": iteration, "checkpointed": checkpointed}
        args = _fit_args(tiny_digits, root, log, 10, halt and {**halt, "path": str(marker)})
        process = start_forked(args + (["--ckpt_path", "last"] if kept else []))
        if halt is None:
            assert process.wait(timeout=600) == 0
        else:
            _halted(marker, process)
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
    assert [lines[0][0] for lines in kept] == [1, 4, 7]  # resumed after iterations 3 and 6
    assert kept[1][-1][0] == 7  # the killed run had trained iteration 7, and it was trained again
    assert Counter(p for _, p in counted) == Counter(p for _, p in whole)
    assert sorted({i for i, _ in counted}) == list(range(1, 10))


@SHARED_RUN  # the synchronous run is test_learning's, run once for both
@pytest.mark.long
def test_the_quickstart_learns_as_well_one_step_off(tiny_digits, tmp_path):
    """The quickstart run of tests/test_learning.py (GAE, kl_coef 0.02) against the same run with
    staleness 1 (61 batches: 60 trained): the score rises by the same bounds, and ends within the
    spread of synchronous runs over seeds. Measured, last-10 % score, seeds 0-3: synchronous 0.870,
    0.873, 0.560, 0.663; one step off 0.760, 0.722, 0.555, 0.602 (0.08 lower on average: each
    update learns from data one update old)."""
    _, synchronous = quickstart_run("gae", tiny_digits, tmp_path / "sync")
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
    run = ranks_process(args)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = _trained(tmp_path / "log")  # rank 0's: 3 iterations of its BATCH prompts
    assert sorted({i for i, _ in lines}) == [1, 2, 3]
    pending = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)["lightning_ppo_pending"]
    assert [len(rank) for rank in pending] == [1, 1]
    assert pending[0][0]["prompts"] != pending[1][0]["prompts"]  # each rank's own batch
    # The epoch that run cut short counts as finished: one batch of a second epoch trains the pending first.
    resumed_args = _fit_args(tiny_digits, root, tmp_path / "log2", 1) + ["--trainer.max_epochs", "2"]
    resumed = ranks_process(
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


class EchoTurns(Environment):
    """Echoes its prompt's digits after each reply, for as many turns as the prompt's first digit
    says (1 to 3): every batch's transcripts and turn counts are its own."""

    def reset(self, prompt, row, rng) -> None:
        self.digits = "".join(c for c in prompt if c.isdigit())
        self.turns = int(self.digits[0]) % 3 + 1

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation=self.digits[:3], done=turn.index + 1 >= self.turns)


class TrainedEpisodes(pl.Callback):
    """Per trained iteration: the logged ``episode/turns_mean``, the prompts and the transcripts."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, list[str], list[str]]] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if module.last_samples is not None and len(self.rows) < module.iteration:
            samples = module.last_samples
            metric = float(trainer.callback_metrics["episode/turns_mean"])
            self.rows.append((metric, list(samples.prompts), list(samples.completions)))


def test_episode_metrics_and_transcripts_logged_are_the_trained_batchs(tiny_digits, tmp_path):
    """One step off, the next batch's episodes run during the update: what is logged for a batch (the
    turns per episode, the transcripts) is still that batch's, not the one sampled meanwhile."""
    pl.seed_everything(0)
    episodes = EpisodeConfig(max_turns=3, max_tokens=64)
    module, record = _module(tiny_digits, 1, environment=EchoTurns(), episode=episodes), TrainedEpisodes()
    quiet_trainer(tmp_path, iterations=5, callbacks=[record]).fit(
        module, DigitsDataModule(num_prompts=5 * 16, batch_size=16, max_prompt_length=16)
    )
    assert len(record.rows) == 4
    for turns_mean, prompts, transcripts in record.rows:
        digits = ["".join(c for c in p if c.isdigit()) for p in prompts]
        assert turns_mean == pytest.approx(sum(int(d[0]) % 3 + 1 for d in digits) / len(digits))
        assert all(t.count(d[:3]) >= int(d[0]) % 3 for t, d in zip(transcripts, digits, strict=True))


def test_positions_seed_each_batch_once_and_a_failing_start_keeps_both_batches():
    """Each job starts at the iteration its batch will train at (its episodes' seed): unique, and the
    same for a batch a checkpoint kept and a resumed run samples again. A start that raises (a server
    sync failed) leaves every batch pending: the one trained before it and the one not started."""
    from lightning_ppo.rollout.ahead import RolloutsAhead, Sampled

    for staleness in (1, 2):
        positions: list[int] = []

        def prepare(batch, position, positions=positions, s=staleness):
            positions.append(position)
            return lambda: Sampled(batch, None, position - s)

        ahead, version = RolloutsAhead(staleness, prepare), 0
        try:
            for step in range(6):
                if ahead.next(f"batch {step}", version) is not None:
                    version += 1
            assert positions == list(range(6))
            kept = ahead.pending()
        finally:
            ahead.close()
        resumed = RolloutsAhead(staleness, prepare)
        positions.clear()
        resumed.restore(kept)
        try:
            resumed.next("batch 6", version)
            assert positions == list(range(version, version + staleness + 1))
        finally:
            resumed.close()

    def failing(batch, position):
        if batch == "batch 1":
            raise ConnectionError("sync failed")
        return lambda: Sampled(batch, None, 0)

    ahead = RolloutsAhead(1, failing)
    try:
        assert ahead.next("batch 0", 0) is None
        with pytest.raises(ConnectionError):
            ahead.next("batch 1", 0)
        assert ahead.pending() == ["batch 0", "batch 1"]
    finally:
        ahead.close()


class FailAfterIteration(pl.Callback):
    """Raises as the step after ``iteration`` starts (its checkpoint saved: Lightning runs the
    checkpoint callbacks last at a batch end)."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def on_train_batch_start(self, trainer, module, *args) -> None:
        if module.iteration == self.iteration:
            raise RuntimeError("stopped on purpose")


class Trained(pl.Callback):
    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.seen = 0

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if module.last_samples is not None and module.iteration > self.seen:
            self.seen = module.iteration
            self.prompts += module.last_samples.prompts


def test_a_second_fit_after_a_failed_one_trains_every_prompt_once(tiny_digits, tmp_path):
    """In one process (a notebook, a retry loop): a fit one step off fails after the checkpoint of
    iteration 3, and ``fit(ckpt_path=...)`` on the same module trains the pending batch first and
    then the rest, each prompt exactly once, as the uninterrupted run. After a fit, a
    ``trainer.save_checkpoint`` keeps the pending batch its cursor counts, as handed in (before the
    ``num_generations`` copies)."""
    from lightning_ppo.checkpoint import PPOCheckpoint

    def data() -> DigitsDataModule:
        return DigitsDataModule(num_prompts=6 * 8, batch_size=8, max_prompt_length=16)

    pl.seed_everything(0)
    whole, whole_module = Trained(), _module(tiny_digits, 1)
    trainer = quiet_trainer(tmp_path / "whole", iterations=6, callbacks=[whole])
    trainer.fit(whole_module, data())
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    pending = torch.load(tmp_path / "after.ckpt", weights_only=True)["lightning_ppo_pending"]
    assert [len(rank) for rank in pending] == [1] and len(pending[0][0]["prompts"]) == 8

    pl.seed_everything(0)
    module, trained = _module(tiny_digits, 1), Trained()
    saver = PPOCheckpoint(dirpath=tmp_path / "ckpt", every_n_iterations=1, save_top_k=-1)
    with pytest.raises(RuntimeError, match="on purpose"):
        callbacks = [trained, saver, FailAfterIteration(3)]
        quiet_trainer(tmp_path / "run", 6, callbacks=callbacks).fit(module, data())
    assert module._ahead is None  # ended when the fit raised
    again = Trained()
    again.seen = 3
    quiet_trainer(tmp_path / "run", 6, callbacks=[again]).fit(
        module, data(), ckpt_path=str(tmp_path / "ckpt" / "iteration=3.ckpt")
    )
    assert module.iteration == 5
    assert Counter(trained.prompts + again.prompts) == Counter(whole.prompts)


def test_groups_are_rebuilt_from_the_batch_as_handed_in(tiny_digits, tmp_path):
    """``num_generations`` 2 one step off: the pending batch a checkpoint keeps is the batch of
    prompts, so a resume with another ``num_generations`` builds whole groups."""
    module = _module(tiny_digits, 1)
    module.ppo = PPOConfig(max_staleness=1, num_generations=2)
    trainer = quiet_trainer(tmp_path, iterations=2)
    trainer.fit(module, DigitsDataModule(num_prompts=16, batch_size=8, max_prompt_length=16))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    pending = torch.load(tmp_path / "after.ckpt", weights_only=True)["lightning_ppo_pending"]
    assert len(pending[0][0]["prompts"]) == 8 and module.episodes == 16


def test_pending_batches_are_not_refused_outside_a_trainer():
    """``load_from_checkpoint`` of a 2-rank checkpoint (no Trainer): nothing is trained there, so
    nothing is refused; a fit with ``ckpt_path`` reads them again with its ranks."""
    assert pending_of_rank([["rank 0's"], ["rank 1's"]], None, 1) == []


class FailsOnRankOne(Environment):
    """Raises in the second batch's episodes of rank 1 only."""

    resets = 0

    def reset(self, prompt, row, rng) -> None:
        FailsOnRankOne.resets += 1
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1 and self.resets > BATCH:
            raise RuntimeError("rank 1's environment broke")

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


@pytest.mark.ranks
def test_one_ranks_failed_background_job_stops_every_rank(tiny_digits, tmp_path, monkeypatch):
    """DDP on 2 CPU ranks one step off: rank 1's background episodes fail on its second batch. Both
    ranks stop (rank 0 with one line naming rank 1's failure), long before the process group's
    timeout: without the agreement rank 0 waited for rank 1 in the gradients' all-reduce."""
    args = _fit_args(tiny_digits, tmp_path / "run", tmp_path / "log", 6) + [
        *("--trainer.devices", "2", "--trainer.strategy", "ddp"),
        *("--model.init_args.environment", "tests.test_async.FailsOnRankOne"),
        *("--model.init_args.episode.max_tokens", "16"),
    ]
    # Both ranks end together, at the agreement; the watcher kills a rank still running 5 s after
    # another failed, which a loaded machine could reach before rank 0 prints its line. A rank that
    # hangs is still caught: without its line, or after the 240 s guard.
    monkeypatch.setattr(StartedRanks, "GRACE_S", 120.0)
    run = ranks_process(args, timeout=240)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("lightning-ppo: error: ")]
    # one line from each rank, in whichever order they print: rank 0 names rank 1's failure
    assert len(errors) == 2, run.stderr[-3000:]
    assert any(line.startswith("lightning-ppo: error: rank 1's background sampling") for line in errors)
    assert all("rank 1's environment broke" in line for line in errors)


def test_behaviour_logprobs_in_row_groups_equal_one_forward(tiny_digits):
    """``generation.forward_chunk_size`` bounds the behaviour log-probs' forwards as the trainer's own
    (no fp32 batch x response x vocabulary at once): the same numbers as one forward of the batch."""
    from lightning_ppo.rollout.ahead import with_behaviour_logprobs
    from lightning_ppo.rollout.sampling import generate

    module = _module(tiny_digits, 1)
    ids = torch.randint(0, 10, (12, 6))
    mask = torch.ones_like(ids)
    mask[:5, :3] = 0  # left padding: rows of different lengths
    rollout = generate(module.policy, ids, mask, module.hf_generation)
    whole = with_behaviour_logprobs(rollout, module.policy, module.token_logprobs)
    chunked = with_behaviour_logprobs(rollout, module.policy, module.token_logprobs, chunk_size=4)
    assert torch.allclose(whole.engine_logprobs, chunked.engine_logprobs, atol=1e-6)
    assert whole.engine_logprobs[rollout.response_mask].abs().sum() > 0


def test_a_batch_saved_before_batches_were_kept_as_handed_in_is_not_copied_twice():
    """A checkpoint written before this change kept each pending batch after its num_generations
    copies (no ``handed_in`` mark): read back, each prompt is there once, not G x G times."""
    from lightning_ppo.rollout.ahead import as_handed_in, to_saved
    from lightning_ppo.rollout.prompts import PromptBatch

    batch = PromptBatch(
        torch.tensor([[1, 2], [3, 4]]),
        torch.ones(2, 2, dtype=torch.long),
        ["a", "b"],
        {"target": ["x", "y"]},
        None,
    )
    old = to_saved(batch.repeat_interleave(4))
    del old["handed_in"]
    mine = as_handed_in(old, copies=4)
    assert mine["prompts"] == ["a", "b"] and mine["extras"] == {"target": ["x", "y"]}
    assert torch.equal(mine["prompt_ids"], batch.prompt_ids)
    assert as_handed_in(to_saved(batch), copies=4)["prompts"] == ["a", "b"]  # a new one as it is
    assert pending_of_rank([[old]], type("One", (), {"world_size": 1, "global_rank": 0})(), 1, 4)[0][
        "prompts"
    ] == ["a", "b"]


def test_a_start_that_failed_on_another_rank_stops_this_one_too():
    """A snapshot that could not be taken on rank 1 (out of memory): rank 0 hears it in the same
    agreement and stops, rather than train on and wait for rank 1 in the gradients' all-reduce."""
    from lightning_ppo.rollout.ahead import RolloutsAhead, Sampled, SamplingStopped

    def rank_one_failed(failure):
        return [failure, "OutOfMemoryError: no room for the snapshot"]

    ahead = RolloutsAhead(1, lambda batch, position: lambda: Sampled(batch, None, 0), rank_one_failed)
    try:
        with pytest.raises(SamplingStopped, match="rank 1's background sampling failed"):
            ahead.next("batch 0", 0)
        assert ahead.pending() == ["batch 0"]
    finally:
        ahead.close()
