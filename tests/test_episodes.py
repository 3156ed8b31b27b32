"""Multi-turn episodes: token continuity, masks, turn rewards, GAE across observations, budgets,
environment failures, and a one-turn environment that reproduces today's single-turn run bit for bit."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import transformers

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.experience import make_experience
from lightning_ppo.rollout.episodes import Environment, EnvironmentFailure, StepResult, Turn
from lightning_ppo.rollout.kept_cache import local_attention
from lightning_ppo.runs.errors import RunStopped, UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from lightning_ppo.tasks.reveal import RevealDigits, RevealDigitsDataModule
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from lightning_ppo.watch.diversity import Diversity
from tests.helpers import quiet_trainer


class Echo(Environment):
    """Answers every turn with "=12=", rewards 0.5 per turn, and records what it was given."""

    def __init__(self) -> None:
        self.seen: list[Turn] = []

    def step(self, turn: Turn) -> StepResult:
        self.seen.append(turn)
        return StepResult(observation="=12=", reward=0.5)


class OneTurn(Environment):
    """Done after the first reply, with nothing to add: today's single-turn episode."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class Raises(Environment):
    def step(self, turn: Turn) -> StepResult:
        if turn.index == 1:
            raise ValueError("the tool is down")
        return StepResult(observation="7=")


def _module(path, environment=None, episode=None, **kwargs) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(path),
        reward_fn=kwargs.pop("reward_fn", DigitsReward()),
        environment=environment,
        episode=episode or EpisodeConfig(max_turns=3, max_tokens=40),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.05),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        **kwargs,
    )


def _batch(module: PPOLightningModule, data=None):
    data = data or DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _turn_logprobs(module: PPOLightningModule, context: list[int], reply: list[int]) -> torch.Tensor:
    """The policy's log-probs of ``reply`` after ``context``, one unpadded sequence: what sampling saw."""
    ids = torch.tensor([context + reply])
    logits = module.policy(input_ids=ids).logits[:, len(context) - 1 : -1]
    return module.token_logprobs(logits, torch.tensor([reply]))[0]


@pytest.mark.parametrize("keep_cache", [False, True], ids=["re-read", "kept cache"])
def test_turns_keep_the_sampled_tokens_and_their_log_probs_across_turns(keep_cache, tiny_digits):
    torch.manual_seed(0)
    module = _module(tiny_digits, Echo(), EpisodeConfig(max_turns=3, max_tokens=40, keep_cache=keep_cache))
    batch = _batch(module)
    rollout = module.generate(batch)
    observation = module.tokenizer("=12=", add_special_tokens=False)["input_ids"]
    forwards = module.rollout_forwards(rollout)
    for row in range(len(batch)):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
        tokens = rollout.response_ids[row][rollout.episode_mask[row]].tolist()
        actions = rollout.response_mask[row][rollout.episode_mask[row]].tolist()
        # replies and observations alternate: every observation is "=12=" exactly, tokenized once
        start, turns = 0, 0
        while start < len(tokens):
            end = start
            while end < len(tokens) and actions[end]:
                end += 1
            reply = tokens[start:end]
            recomputed = _turn_logprobs(module, prompt + tokens[:start], reply)
            trained = forwards.logprobs[row][rollout.episode_mask[row]][start:end]
            torch.testing.assert_close(trained, recomputed, atol=1e-5, rtol=1e-5)
            turns += 1
            if end < len(tokens):
                assert tokens[end : end + len(observation)] == observation
            start = end + len(observation)
        assert turns == 3  # max_turns: Echo never says done
    # observations are context: no log-prob, KL or value there; turn rewards on each turn's last token
    context = rollout.context_mask
    assert context is not None and (forwards.logprobs[context] == 0).all()
    assert rollout.turn_rewards.sum(1).tolist() == [1.5] * len(batch)
    action = rollout.response_mask
    following = torch.cat([action[:, 1:], torch.zeros_like(action[:, :1])], dim=1)
    assert torch.equal(rollout.turn_rewards != 0, action & ~following)


class Recorder(Echo):
    """Echo that also writes every turn it sees to a list shared by all its copies."""

    log: list[Turn] = []

    def step(self, turn: Turn) -> StepResult:
        Recorder.log.append(turn)
        return super().step(turn)


def test_each_episode_runs_on_its_own_copy_and_reads_its_turns_as_sampled(tiny_digits):
    torch.manual_seed(1)
    template = Recorder()
    Recorder.log.clear()
    # one step at a time: the shared log is then in the episodes' order
    module = _module(tiny_digits, template, EpisodeConfig(max_turns=2, max_tokens=40, max_concurrency=1))
    rollout = module.generate(_batch(module))
    assert template.seen == []  # the configured instance itself is never stepped
    first_turns = [turn for turn in Recorder.log if turn.index == 0]
    assert len(first_turns) == len(rollout.response_ids) == 8
    for row, turn in enumerate(first_turns):
        tokens = rollout.response_ids[row][: len(turn.token_ids)].tolist()
        assert turn.token_ids == tokens and rollout.response_mask[row][: len(tokens)].all()
        assert turn.text == module.tokenizer.decode(tokens, skip_special_tokens=True)
        assert turn.ended == (tokens[-1] == module.stop_token_id)


def test_gae_bootstraps_across_an_observation_from_the_next_action():
    # tokens: a0 a1 [obs obs] a2; rewards 1 at a1 (turn reward) and 2 at a2 (score); gamma 1, lambda 1
    mask = torch.tensor([[True, True, False, False, True]])
    rewards = torch.tensor([[0.0, 1.0, 9.0, 9.0, 2.0]])  # observation rewards are never read
    values = torch.tensor([[0.5, 0.25, 7.0, 7.0, 1.0]])
    advantages, returns = F.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert returns[0].tolist() == [3.0, 3.0, 0.0, 0.0, 2.0]
    assert advantages[0, 1].item() == pytest.approx(3.0 - 0.25)  # the return from a1 minus V(a1)
    advantages, _ = F.gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert advantages[0, 1].item() == pytest.approx(1.0 + 1.0 - 0.25)  # one-step: bootstraps from V(a2)


def test_turn_rewards_and_the_score_land_on_their_tokens(tiny_digits):
    torch.manual_seed(2)
    module = _module(tiny_digits, Echo())
    rollout = module.generate(_batch(module))
    zeros = torch.zeros_like(rollout.response_ids, dtype=torch.float32)
    scores = torch.arange(len(rollout.response_ids), dtype=torch.float32)
    exp = make_experience(rollout, zeros, zeros, zeros, scores, 0.0, PPOConfig(whiten_advantages=False))
    last_action = rollout.response_mask.long().cumsum(1).argmax(1)
    expected = rollout.turn_rewards.clone()
    expected[torch.arange(len(scores)), last_action] += scores
    torch.testing.assert_close(exp.rewards, expected)


def test_an_episode_over_its_token_budget_is_cut_and_counted(tiny_digits):
    torch.manual_seed(3)
    module = _module(tiny_digits, Echo(), EpisodeConfig(max_turns=5, max_tokens=9))
    rollout = module.generate(_batch(module))
    stats = module.episode_runner.last_stats
    assert rollout.response_ids.shape[1] <= 9 and stats.tokens.max().item() <= 9
    assert stats.truncated.any() and (stats.turns < 5).all()


def test_an_environment_that_raises_is_named_or_its_episode_dropped(tiny_digits):
    torch.manual_seed(4)
    module = _module(tiny_digits, Raises())
    batch = _batch(module)
    with pytest.raises(
        EnvironmentFailure,
        match=r"model.environment: Raises.step raised ValueError: the tool is down \(turn 1, prompt '\d+='\)",
    ):
        module.generate(batch)
    dropping = _module(tiny_digits, Raises(), EpisodeConfig(max_turns=3, max_tokens=40, on_error="drop"))
    rollout = dropping.generate(batch)
    stats = dropping.episode_runner.last_stats
    assert stats.failed.all() and not rollout.response_mask.any()  # nothing to learn from them


def test_a_one_turn_environment_trains_exactly_as_the_single_turn_path(tiny_digits, tmp_path):
    runs = []
    for environment in (None, OneTurn()):
        torch.manual_seed(0)
        module = _module(tiny_digits, environment)
        data = DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
        quiet_trainer(tmp_path, iterations=3).fit(module, datamodule=data)
        runs.append(module)
    plain, episodic = runs
    for name, value in plain.state_dict().items():
        assert torch.equal(value, episodic.state_dict()[name]), name
    assert plain.kl_ctl.value == episodic.kl_ctl.value


def test_the_reveal_task_needs_the_observation_to_score(tiny_digits):
    torch.manual_seed(5)
    module = _module(tiny_digits, RevealDigits(), EpisodeConfig(max_turns=2, max_tokens=24), reward_fn=None)
    data = RevealDigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    batch = _batch(module, data)
    assert set(batch.prompts) == {"="}
    rollout = module.generate(batch)
    text = module.decode_responses(rollout)
    targets = batch.extras["target"]
    assert all(f"{t}=" in episode for t, episode in zip(targets, text, strict=True))  # revealed in turn 2
    assert rollout.turn_rewards is not None and (rollout.turn_rewards.sum(1) >= 0).all()


def _fit_reveal(policy, root, iterations: int, ckpt_path=None, callbacks=()):
    """Multi-turn GRPO (groups of 2 episodes of one prompt) with the environment's own random
    generator in play: everything a resumed run must reproduce."""
    pl.seed_everything(0)
    module = PPOLightningModule(
        policy=str(policy),
        environment=ShuffledReveal(),
        episode=EpisodeConfig(max_turns=2, max_tokens=18),
        ppo=PPOConfig(advantage_estimator="grpo", num_generations=2, ppo_epochs=1, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = RevealDigitsDataModule(num_prompts=32, batch_size=4, max_prompt_length=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=-1,
        max_steps=iterations * 2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


class ShuffledReveal(RevealDigits):
    """Reveals the digits in an order drawn from the episode's generator."""

    def reset(self, prompt, row, rng):
        super().reset(prompt, row, rng)
        self.target = "".join(rng.sample(self.target, len(self.target)))


def test_a_multi_turn_grpo_run_resumes_exactly(tiny_digits, tmp_path):
    full = _fit_reveal(tiny_digits, tmp_path / "full", iterations=4)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    _fit_reveal(tiny_digits, tmp_path / "half", iterations=2, callbacks=[saver])
    resumed = _fit_reveal(tiny_digits, tmp_path / "resumed", 4, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.iteration == full.iteration == 4
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert resumed.episode_runner.transcripts == full.episode_runner.transcripts


@pytest.mark.parametrize("layout", ["shared", "lora"])
def test_episodes_train_with_the_shared_critic_and_with_lora(layout, tiny_digits, tmp_path):
    torch.manual_seed(0)
    extra = {"value_model": "shared"} if layout == "shared" else {"lora": LoraSettings(r=4)}
    module = _module(tiny_digits, Echo(), EpisodeConfig(max_turns=2, max_tokens=20), **extra)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    data = DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)
    quiet_trainer(tmp_path, iterations=2).fit(module, datamodule=data)
    changed = [n for n, p in module.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and module.episode_runner.last_stats.turns.float().mean() == 2.0


class ChatReply(Environment):
    """Answers in the chat: a user message the template wraps, then the assistant's turn opens."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation={"role": "user", "content": "more"})


def test_a_chat_message_observation_is_written_as_the_template_writes_it(tmp_path):
    from transformers import AutoTokenizer

    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / "chat", TinyModelSpec(), alphabet="0123456789abcdefghijklmnopqrstuvwxyz<>|="
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(path)
    torch.manual_seed(6)
    module = _module(path, ChatReply(), EpisodeConfig(max_turns=2, max_tokens=40), reward_fn=None)
    rollout = module.generate(_batch(module))
    expected = module.tokenizer("<|user|>more<eos><|assistant|>", add_special_tokens=False)["input_ids"]
    for row in range(len(rollout.response_ids)):
        context = rollout.response_ids[row][rollout.context_mask[row]].tolist()
        assert context == expected
    assert all(" [env: user: more] " in text for text in module.episode_runner.transcripts)


def test_a_rank_whose_episodes_ended_still_takes_the_turns_another_rank_needs(tiny_digits):
    """Under FSDP2 every forward gathers weights with every rank: a rank whose episodes all ended
    generates a throw-away reply while another rank still needs the turn, and keeps its own."""
    calls = []

    def another_rank_still_running(flag: bool) -> bool:
        calls.append(flag)
        return True

    module = _module(tiny_digits, OneTurn(), EpisodeConfig(max_turns=3, max_tokens=40))
    batch = _batch(module)
    torch.manual_seed(7)
    alone = module.generate(batch)
    torch.manual_seed(7)
    module.engine.sync_weights(module.policy)
    in_step = module.episode_runner.run(module.engine, batch, 0, 0, another_rank_still_running)
    assert calls == [True, False, False]  # this rank's episodes ended after turn 0; it went on anyway
    assert torch.equal(in_step.response_ids, alone.response_ids)
    assert torch.equal(in_step.response_mask, alone.response_mask)


def test_the_episode_budget_is_checked_against_the_positions_before_any_model_loads(tiny_digits, capsys):
    from lightning_ppo.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "agents.yaml")
    args = ["fit", "--config", config, "--model.init_args.policy", str(tiny_digits)]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--model.init_args.episode.max_tokens", "200"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "data.max_prompt_length (16) + model.episode.max_tokens (200) = 216 tokens, more than the 128 "
        f"positions of model.policy {str(tiny_digits)!r} (n_positions in its config): lower one of them"
    )
    assert "Traceback" not in "\n".join(err)


def test_a_stateless_step_function_named_by_import_path_runs_episodes(tiny_digits, tmp_path):
    from lightning_ppo.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "agents.yaml")
    cli = main(
        [
            *("fit", "--config", config, "--model.init_args.policy", str(tiny_digits)),
            *("--model.init_args.environment", "lightning_ppo.tasks.reveal.reveal_step"),
            *("--trainer.limit_train_batches", "2", "--trainer.logger", "false"),
            *("--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"),
            *("--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)),
        ]
    )
    runner = cli.model.episode_runner
    assert runner.last_stats.turns.tolist() == [2] * 64
    assert all(" [env: " in text for text in runner.transcripts)


def test_an_environment_that_raises_stops_the_run_in_one_line_and_leaves_the_checkpoint(
    tiny_digits, tmp_path
):
    from tests.helpers import forked_cli_process, quickstart_fit_args

    config = Path(__file__).resolve().parents[1] / "configs" / "agents.yaml"
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "dirpath": str(tmp_path / "ckpt")},
    }
    env = '{"class_path": "tests.helpers.FailsInTheSecondIteration"}'
    args = quickstart_fit_args(tiny_digits, tmp_path, [saver], config=config)
    done = forked_cli_process(
        [*args, "--model.init_args.environment", env, "--trainer.limit_train_batches", "3"]
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in done.stderr
    assert lines[-1].endswith(
        "model.environment: FailsInTheSecondIteration.step raised ConnectionError: the sandbox went away "
        "(turn 0, prompt '=')"
    )
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["ppo_state"]["iteration"] == 1  # the first iteration's checkpoint, whole


class Uneven(Environment):
    """Observations of different lengths, and episodes that end after different turns (by rng)."""

    def reset(self, prompt, row, rng) -> None:
        self.rng = rng

    def step(self, turn: Turn) -> StepResult:
        length = self.rng.randrange(1, 6)
        return StepResult(observation="7" * length + "=", reward=0.1, done=self.rng.random() < 0.3)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_kept_cache_gives_the_episodes_the_re_read_gives(sampling, tiny_digits):
    """The cache kept across turns reads only each observation; every real token still sees what it
    saw, at the same position, so greedy episodes are the re-read path's token for token (sampled
    ones too here: the same draws over logits equal to float rounding)."""
    rollouts = []
    for keep_cache in (False, True):
        module = _module(
            tiny_digits, Uneven(), EpisodeConfig(max_turns=4, max_tokens=40, keep_cache=keep_cache)
        )
        if sampling == "greedy":
            module.engine.generation_config = module.hf_eval_generation
        torch.manual_seed(5)
        rollouts.append(module.generate(_batch(module)))
    reread, kept = rollouts
    assert reread.context_mask.any() and module.episode_runner.last_stats.turns.unique().numel() > 1
    for name in ("response_ids", "response_mask", "context_mask", "turn_rewards", "ended"):
        assert torch.equal(getattr(kept, name), getattr(reread, name)), name


class SometimesSilent(Environment):
    """Not done, and some turns answer with nothing: no observation, or an empty one."""

    def reset(self, prompt, row, rng) -> None:
        self.rng = rng

    def step(self, turn: Turn) -> StepResult:
        observation = self.rng.choice([None, "", "7=", "12="])
        return StepResult(observation=observation, reward=0.1)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_kept_cache_continues_a_turn_without_an_observation_from_the_reply(sampling, tiny_digits):
    """An episode whose step adds nothing goes on from its reply's last token, as the re-read path
    does: never from the padding after it, whose id would be sampled and trained as an action."""
    rollouts = []
    for keep_cache in (False, True):
        module = _module(
            tiny_digits, SometimesSilent(), EpisodeConfig(max_turns=4, max_tokens=40, keep_cache=keep_cache)
        )
        if sampling == "greedy":
            module.engine.generation_config = module.hf_eval_generation
        torch.manual_seed(5)
        rollouts.append(module.generate(_batch(module)))
    reread, kept = rollouts
    assert (module.episode_runner.last_stats.turns == 4).any()  # some went on after adding nothing
    for name in ("response_ids", "response_mask", "context_mask", "turn_rewards", "ended"):
        assert torch.equal(getattr(kept, name), getattr(reread, name)), name


class FailsResetOn(Environment):
    """Raises in ``reset`` for one prompt; every other copy writes the replies it was given, with its
    prompt, to a log shared by the copies."""

    log: list[tuple[str, int, list[int]]] = []

    def __init__(self, failing_prompt: str) -> None:
        self.failing_prompt = failing_prompt

    def reset(self, prompt, row, rng) -> None:
        if prompt == self.failing_prompt:
            raise ValueError("no sandbox for this one")
        self.prompt = prompt

    def step(self, turn: Turn) -> StepResult:
        FailsResetOn.log.append((self.prompt, turn.index, turn.token_ids))
        return StepResult(observation="=12=")


@pytest.mark.parametrize("keep_cache", [False, True], ids=["re-read", "kept cache"])
@pytest.mark.parametrize("failing", [2, 7], ids=["middle", "last"])
def test_a_reset_that_fails_drops_its_episode_and_the_others_get_their_own_replies(
    failing, keep_cache, tiny_digits
):
    torch.manual_seed(6)
    probe = _module(tiny_digits)
    batch = _batch(probe)
    assert len(set(batch.prompts)) == len(batch)  # the log tells the episodes apart by their prompt
    FailsResetOn.log.clear()
    config = EpisodeConfig(max_turns=3, max_tokens=40, on_error="drop", keep_cache=keep_cache)
    module = _module(tiny_digits, FailsResetOn(batch.prompts[failing]), config)
    rollout = module.generate(batch)
    stats = module.episode_runner.last_stats
    assert stats.failed.tolist() == [row == failing for row in range(len(batch))]
    assert not rollout.response_mask[failing].any() and stats.turns[failing] == 0
    observation = module.tokenizer("=12=", add_special_tokens=False)["input_ids"]
    for row, prompt in enumerate(batch.prompts):
        seen = [(turn, ids) for p, turn, ids in FailsResetOn.log if p == prompt]
        if row == failing:
            assert seen == []
            continue
        assert [turn for turn, _ in seen] == [0, 1, 2]
        tokens = rollout.response_ids[row][rollout.episode_mask[row]].tolist()
        expected = []
        for _, ids in seen:  # the episode's tokens are its replies as its environment read them
            expected += ids + observation
        assert tokens == expected[: len(tokens)] and len(tokens) == len(expected) - len(observation)


class KeepsCallsAndErrors(Echo):
    """An environment with attributes named as the tools' counters."""

    def reset(self, prompt, row, rng) -> None:
        self.calls, self.errors = [prompt], "none yet"


def test_an_environment_may_name_its_attributes_calls_and_errors(tiny_digits):
    module = _module(tiny_digits, KeepsCallsAndErrors(), EpisodeConfig(max_turns=2, max_tokens=40))
    module.generate(_batch(module))
    metrics = module.episode_runner.metrics()
    assert metrics["episode/tool_calls"].item() == metrics["episode/tool_errors"].item() == 0


class HoldsALock(Echo):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class SharesALock(HoldsALock):
    shared = ("lock",)
    locks: list[threading.Lock] = []

    def step(self, turn: Turn) -> StepResult:
        with self.lock:
            SharesALock.locks.append(self.lock)
        return super().step(turn)


def test_an_environment_that_cannot_be_copied_is_one_line_before_training_or_shares_it(tiny_digits):
    with pytest.raises(
        UsageError,
        match=r"^model.environment: HoldsALock cannot be copied for each episode \(copy.deepcopy raised "
        r"TypeError: cannot pickle '_thread.lock' object\): name the attribute in the class's `shared`",
    ):
        _module(tiny_digits, HoldsALock())
    template = SharesALock()
    SharesALock.locks.clear()
    module = _module(tiny_digits, template, EpisodeConfig(max_turns=2, max_tokens=40))
    module.generate(_batch(module))
    assert len(SharesALock.locks) == 16 and all(lock is template.lock for lock in SharesALock.locks)
    assert template.seen == []  # the other attributes are still each episode's own


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """A 2 x 64 Mistral over the digit vocabulary, attending within a window of 32 tokens."""
    spec = TinyModelSpec(arch="mistral", n_positions=64)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), spec, alphabet="0123456789=")


def test_keep_cache_is_refused_before_training_for_a_sliding_window_model(tiny_mistral, tmp_path):
    refused = (
        r"^model.episode.keep_cache: the policy \(mistral\) attends within a sliding window of 32 tokens"
    )
    config = EpisodeConfig(max_turns=2, max_tokens=40, keep_cache=True)
    module = _module(tiny_mistral, Echo(), config)
    data = DigitsDataModule(num_prompts=16, batch_size=8, max_prompt_length=16)
    with pytest.raises(UsageError, match=refused):
        quiet_trainer(tmp_path, iterations=1).fit(module, data)
    assert module.iteration == 0  # refused in setup: not one rollout
    with pytest.raises(UsageError, match=refused):  # outside a Trainer too
        _module(tiny_mistral, Echo(), config).generate(_batch(module))
    reread = _module(tiny_mistral, Echo(), EpisodeConfig(max_turns=2, max_tokens=40))
    assert reread.generate(_batch(reread)).context_mask.any()  # the re-read path serves it


@pytest.mark.parametrize(
    ("config", "local"),
    [
        (transformers.LlamaConfig(), None),
        (transformers.Qwen2Config(), None),
        (
            transformers.Qwen2Config(use_sliding_window=True, sliding_window=64),
            "a sliding window of 64 tokens",
        ),
        (transformers.MistralConfig(sliding_window=None), None),
        (transformers.Gemma2Config(sliding_window=512), "a sliding window of 512 tokens"),
        (transformers.Gemma3Config(), "a sliding window of 4096 tokens"),
        (transformers.Llama4TextConfig(attention_chunk_size=256), "chunks of 256 tokens"),
    ],
    ids=["llama", "qwen2", "qwen2-sliding", "mistral-no-window", "gemma2", "gemma3", "llama4"],
)
def test_which_models_attend_within_a_window(config, local):
    assert local_attention(config) == local


class ResetsFail(Environment):
    """Every reset raises: under ``on_error: drop`` every episode of every batch is dropped."""

    def reset(self, prompt, row, rng) -> None:
        raise ConnectionError("the sandbox is down")

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class NaNTurnReward(Environment):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(reward=float("nan"), done=True)


class FailsOddResets(Environment):
    """Drops the episodes whose prompt starts with an odd digit; the others end after one reply."""

    def reset(self, prompt, row, rng) -> None:
        if int(prompt[0]) % 2:
            raise ValueError("odd")

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class SeenByReward(DigitsReward):
    """The digits reward, keeping the prompts of every completion it scored."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[str]] = []

    def __call__(self, prompts, completions, batch):
        self.prompts.append(list(prompts))
        return super().__call__(prompts, completions, batch)


def _dropping(policy, environment, reward, **ppo) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=reward,
        environment=environment,
        episode=EpisodeConfig(max_turns=2, max_tokens=20, on_error="drop"),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, on_bad_reward="drop", **ppo),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )


@pytest.mark.parametrize("environment", [ResetsFail(), NaNTurnReward()], ids=["reset raises", "NaN reward"])
def test_an_iteration_whose_every_episode_was_dropped_trains_nothing_and_counts_as_a_skip(
    environment, tiny_digits, tmp_path
):
    """Before, only the rows the rewards dropped counted: the update ran on empty masks (AdamW's
    weight decay moved every weight), the rewards scored the dropped episodes, objective/scores
    logged 0.0 and ppo.max_consecutive_skips never fired."""
    reward = SeenByReward()
    module = _dropping(tiny_digits, environment, reward, max_consecutive_skips=3)
    before = {name: value.clone() for name, value in module.state_dict().items()}
    data = DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    trainer = quiet_trainer(tmp_path, iterations=2)
    trainer.fit(module, datamodule=data)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert trainer.global_step == 0 and module.iteration == 2 and module.dropped_in_a_row == 2
    assert reward.prompts == [] and "objective/scores" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["episode/env_errors"]) == 8.0
    stopping = _dropping(tiny_digits, environment, SeenByReward(), max_consecutive_skips=2)
    with pytest.raises(RunStopped, match=r"^every episode was dropped for 2 iterations in a row \("):
        quiet_trainer(tmp_path, iterations=3).fit(stopping, datamodule=data)
    assert stopping.iteration == 2


def test_a_dropped_episode_is_not_scored_nor_in_the_score_moments(tiny_digits, tmp_path):
    """Before, the rewards scored every episode, the dropped ones too, and their scores entered the
    running moments that ppo.score_norm divides by."""
    torch.manual_seed(0)
    reward = SeenByReward()
    module = _dropping(tiny_digits, FailsOddResets(), reward, score_norm=True)
    data = DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=data)
    shown = module.last_samples.prompts
    kept = [prompt for prompt in shown if int(prompt[0]) % 2 == 0]
    assert 0 < len(kept) < len(shown)
    assert reward.prompts == [kept] and module.score_moments.count == len(kept)
    assert trainer.global_step == 4  # the kept episodes trained
    # counted as the environment's (episode/env_errors), not as the rewards' NaN (reward/dropped)
    assert float(trainer.callback_metrics["episode/env_errors"]) == len(shown) - len(kept)
    assert float(trainer.callback_metrics["reward/dropped"]) == 0.0
    scores = module.last_samples.scores
    assert [math.isnan(score) for score in scores] == [prompt not in kept for prompt in shown]


def test_a_dropped_episode_gives_the_diversity_checks_no_answer(tiny_digits, tmp_path):
    """Before, a dropped episode counted as the empty answer: here the 2 dropped ones and a kept one
    read as 3 of 8 prompts given one answer, '' (diversity/top_share 0.375 for 1/6; half a batch
    dropped while the score rose read as answers converging)."""
    torch.manual_seed(0)
    module = _dropping(tiny_digits, FailsOddResets(), SeenByReward())
    data = DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=data)
    samples = zip(module.last_samples.prompts, module.last_samples.completions, strict=True)
    kept = [(prompt, text) for prompt, text in samples if int(prompt[0]) % 2 == 0]
    expected = Diversity.of([prompt for prompt, _ in kept], [text for _, text in kept]).top_share
    assert len(kept) == 6 and expected == pytest.approx(1 / 6)  # six different answers
    assert float(trainer.callback_metrics["diversity/top_share"]) == pytest.approx(expected)


class Explains(Environment):
    """After the first reply, the same long observation for every episode; done after the second."""

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 0:
            return StepResult(observation="=0123456789876543210=")
        return StepResult(reward=0.5, done=True)


def test_the_converging_check_reads_the_policys_replies_not_the_observations(tiny_digits, tmp_path):
    """Before, it read whole episodes: every episode held the environment's observation, so answers to
    different prompts read as near-copies sharing it (most of each episode's text). The sample
    tables still show the whole episode."""
    torch.manual_seed(0)
    module = _module(tiny_digits, Explains(), EpisodeConfig(max_turns=2, max_tokens=40))
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16))
    assert module.guardrails.converging_in_a_row == 0  # 1 before: near-copies in this iteration
    assert all(" [env: =0123456789876543210=] " in text for text in module.last_samples.completions)
