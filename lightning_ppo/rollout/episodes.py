"""Multi-turn episodes: the policy acts, an environment answers, the policy acts again.

An :class:`Environment` is a small Python class named in the config by ``class_path``
(``model.environment``). Each episode runs on its own copy of it (``copy.deepcopy`` of the
configured instance, so it may keep the episode's state in ``self``): :meth:`Environment.reset`
receives the dataset row, :meth:`Environment.step` each turn of the policy, and answers with a
:class:`StepResult`: an observation to append, an optional reward for that turn, and whether the
episode is done.

:class:`EpisodeRunner` advances the episodes of one batch together: one batched ``generate`` per
turn over the episodes still running, with whichever engine samples (``hf`` or ``vllm``). The
policy's tokens are kept exactly as sampled, never decoded and re-encoded; only observations are
tokenized. The result is one :class:`~lightning_ppo.ppo.rollout_data.Rollout` whose response region holds
every turn and observation in order, so the rest of PPO runs unchanged on it: the observations
are context (``context_mask``), never actions, and each turn's reward sits on the turn's last
token (``turn_rewards``). An episode whose environment is done after the first reply is exactly
today's single-turn rollout (the same tensors, bit for bit).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_ppo.config import EpisodeConfig
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.answers import (
    BadEnvironmentReward,
    EnvironmentFailure,
    EnvironmentTimeout,
    step_result,
    value_of,
)
from lightning_ppo.rollout.chat import MessageRenderer
from lightning_ppo.rollout.engines import GenerationEngine
from lightning_ppo.rollout.engines.hf import HFEngine
from lightning_ppo.rollout.environment import Environment, StepFunction, StepResult, Turn
from lightning_ppo.rollout.kept_cache import KeptCache, check_full_attention
from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.rollout.tools import ToolEnvironment, tool_counts
from lightning_ppo.runs.bounded_calls import Outcome, run_bounded
from lightning_ppo.runs.errors import UsageError

# The environment protocol lives in lightning_ppo.rollout.environment (tools.py builds on it without the
# runner); configs and the docs name it here, as lightning_ppo.rollout.episodes.Environment.
__all__ = [
    "Environment",
    "EnvironmentFailure",
    "EpisodeRunner",
    "StepFunction",
    "StepResult",
    "Turn",
    "copy_for_an_episode",
    "make_episode_runner",
]

# How sample tables mark an environment's observation inside an episode's text.
OBSERVATION_OPEN, OBSERVATION_CLOSE = " [env: ", "] "


@dataclass
class _Episode:
    """One episode under construction: its tokens after the prompt, and what each one is."""

    environment: Environment
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    is_action: list[bool] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)  # token index -> turn reward
    turns: int = 0
    last_reply: int = 0  # tokens of the latest reply as kept (0: cut away by the budget)
    cached: int = 0  # tokens after the prompt that a kept cache (episode.keep_cache) holds
    transcript: list[str] = field(default_factory=list)  # replies as text, observations marked
    words: list[str] = field(default_factory=list)  # each reply's own words (Environment.own_words)
    ended: bool = False  # the last reply emitted the stop token
    truncated: bool = False  # cut by the token budget
    failed: bool = False  # dropped (episode.on_error or ppo.on_bad_reward: drop): nothing to learn from it
    failure: str = ""  # why: "error", "timeout" or "bad_reward"
    done: bool = False


@dataclass
class EpisodeStats:
    """What the runner counted in one batch (this rank's episodes)."""

    turns: Tensor  # (B,) policy turns per episode
    tokens: Tensor  # (B,) tokens after the prompt, observations included
    truncated: Tensor  # (B,) bool: cut by episode.max_tokens
    failed: Tensor  # (B,) bool: the environment raised and the episode was dropped
    timeouts: Tensor  # (B,) bool: a reset or step did not answer in time and the episode was dropped
    bad_rewards: Tensor  # (B,) bool: a step's reward was NaN/inf and the episode was dropped
    tool_calls: Tensor  # (B,) tool calls per episode (model.tools)
    tool_errors: Tensor  # (B,) of which failed: malformed, unknown tool, or the tool raised

    def metrics(self, reduce: F.Reduce | None = None) -> dict[str, Tensor]:
        """Turns and tokens per episode (means); episodes truncated and dropped (of those, the ones
        that timed out and those with a NaN/inf reward), tool calls and failed tool calls (counts),
        over every rank's episodes when ``reduce`` sums over the ranks."""
        sums = torch.stack(
            [
                self.turns.float().sum(),
                self.tokens.float().sum(),
                self.truncated.float().sum(),
                self.failed.float().sum(),
                self.timeouts.float().sum(),
                self.bad_rewards.float().sum(),
                self.tool_calls.float().sum(),
                self.tool_errors.float().sum(),
                torch.tensor(float(len(self.turns)), dtype=torch.float32, device=self.turns.device),
            ]
        )
        if reduce is not None:
            sums = reduce(sums)
        turns, tokens, truncated, failed, timeouts, bad_rewards, calls, errors, count = sums
        return {
            "episode/turns_mean": turns / count,
            "episode/tokens_mean": tokens / count,
            "episode/truncated": truncated,
            "episode/env_errors": failed,
            "episode/timeouts": timeouts,
            "episode/bad_rewards": bad_rewards,
            "episode/tool_calls": calls,
            "episode/tool_errors": errors,
        }


class EpisodeRunner:
    """Runs the batch's episodes turn by turn with a generation engine.

    Args:
        environment: The configured environment; every episode runs on a deep copy.
        config: Turns and token budget.
        tokenizer: Decodes the policy's turns for the environment and tokenizes observations.
        pad_token_id: Fills the response region past each episode's end.
        seed: The run's seed; with the iteration, rank and episode it seeds each episode's ``rng``.
        stop_token: The text of the token that ends a reply (``generation.stop_token``; ``None``: EOS),
            where a chat message observation starts.
        on_bad_reward: ``ppo.on_bad_reward``, for a step's NaN/inf reward: ``error`` or ``drop``.

    The environments' ``reset`` and ``step`` calls of a batch run concurrently
    (``episode.max_concurrency``, ``episode.step_timeout``: ``lightning_ppo.runs.bounded_calls``);
    their answers are taken in the episodes' order, so a run repeats whatever order they finish in.
    """

    def __init__(
        self,
        environment: Environment,
        config: EpisodeConfig,
        tokenizer: Any,
        pad_token_id: int,
        seed: int,
        stop_token: str | None = None,
        on_bad_reward: str = "error",
    ) -> None:
        if not callable(getattr(environment, "step", None)):
            raise UsageError(
                f"model.environment: {type(environment).__name__} has no step(turn) method; subclass "
                "lightning_ppo.rollout.episodes.Environment"
            )
        copy_for_an_episode(environment)  # before training: one that cannot be copied is one line now
        self.environment, self.config = environment, config
        self.tokenizer, self.pad_token_id, self.seed = tokenizer, pad_token_id, seed
        self.on_bad_reward = on_bad_reward
        self.last_stats: EpisodeStats | None = None
        # The last batch's episodes as text, observations between OBSERVATION_OPEN and _CLOSE: what
        # the sample tables show (rewards get the plain text, as the policy read it).
        self.transcripts: list[str] = []
        # The policy's own words in each of the last batch's episodes, its replies' (without the
        # observations, or what Environment.own_words leaves out): what the diversity checks read.
        # None for a dropped episode: it gave no answer.
        self.own_words: list[str | None] = []
        self._engine_logprobs = False
        self.render_message = MessageRenderer(tokenizer, stop_token)

    def metrics(self, reduce: Any = None) -> dict[str, Tensor]:
        """``episode/*`` metrics of the last batch (over every rank's episodes with ``reduce``)."""
        if self.last_stats is None:
            return {}
        return self.last_stats.metrics(reduce)

    def run(
        self,
        engine: GenerationEngine,
        batch: PromptBatch,
        iteration: int,
        rank: int,
        any_rank: Callable[[bool], bool] = bool,
    ) -> Rollout:
        """Sample every episode of ``batch`` to its end; one ``engine.generate`` per turn.

        ``any_rank`` says whether a flag is true on any rank (an all-reduce under several ranks): all
        ranks take the same number of turns, because a sharded policy (FSDP2) gathers its weights in
        every forward, with every rank. A rank whose episodes have all ended generates a throw-away
        reply on one of its contexts while another rank still needs the turn.
        """
        episodes = self._start(batch, iteration, rank)
        kept = self._kept_cache(engine)
        generated: list[int] = []  # the episodes of the last turn's generate, in its rows
        for turn in range(self.config.max_turns):
            running = [i for i, episode in enumerate(episodes) if not episode.done]
            if not any_rank(bool(running)):
                break
            if turn == 0 and kept is not None:
                rollout = kept.first(batch.prompt_ids, batch.prompt_mask)
            elif turn == 0:  # the batch's own tensors: one turn is today's rollout exactly
                rollout = engine.generate(batch.prompt_ids, batch.prompt_mask)
            elif not running:
                engine.generate(*self._contexts(episodes[:1], batch))  # in step with the other ranks
                continue
            elif kept is not None:  # each episode's tokens since its reply: the observation
                segments = [episodes[i].tokens[episodes[i].cached :] for i in running]
                rollout = kept.next([generated.index(i) for i in running], segments)
            else:
                rollout = engine.generate(*self._contexts([episodes[i] for i in running], batch))
            # turn 0 samples a row for every episode, one whose reset failed (dropped) included
            generated = list(range(len(episodes))) if turn == 0 else running
            self._engine_logprobs = rollout.engine_logprobs is not None
            turns = [self._reply(episodes[i], rollout, generated.index(i), turn) for i in running]
            steps = [partial(episodes[i].environment.step, t) for i, t in zip(running, turns, strict=True)]
            for i, outcome in zip(running, self._bounded(steps), strict=True):
                try:
                    self._answer(episodes[i], outcome, turn, batch.prompts[i])
                except EnvironmentFailure as failure:
                    self._drop_or_raise(episodes[i], failure)
        return self._rollout(episodes, batch)

    def check_model(self, config: Any) -> None:
        """Before training: whether the policy (its HF ``config``) suits the episode settings."""
        if self.config.keep_cache:
            check_full_attention(config)

    def _kept_cache(self, engine: GenerationEngine) -> KeptCache | None:
        """``episode.keep_cache`` under ``hf``: a cache kept across this batch's turns."""
        if not self.config.keep_cache or not isinstance(engine, HFEngine) or engine.policy is None:
            return None
        check_full_attention(engine.policy.config)  # also outside a Trainer (no setup ran)
        return KeptCache(engine.policy, engine.generation_config)

    def _bounded(self, calls: list[Callable[[], Any]]) -> list[Outcome]:
        return run_bounded(calls, self.config.step_timeout, self.config.max_concurrency)

    def _drop_or_raise(self, episode: _Episode, failure: EnvironmentFailure) -> None:
        """Stop the run with ``failure`` (``episode.on_error``, ``ppo.on_bad_reward``), or drop the
        episode: out of the update, counted by why."""
        bad_reward = isinstance(failure, BadEnvironmentReward)
        if (self.on_bad_reward if bad_reward else self.config.on_error) == "error":
            raise failure
        episode.failed = episode.done = True
        episode.failure = (
            "bad_reward" if bad_reward else "timeout" if isinstance(failure, EnvironmentTimeout) else "error"
        )

    def _start(self, batch: PromptBatch, iteration: int, rank: int) -> list[_Episode]:
        """The batch's episodes, each on its own copy of the environment, reset together."""
        episodes, resets = [], []
        for i in range(len(batch)):
            environment = copy_for_an_episode(self.environment)
            episodes.append(_Episode(environment, batch.prompt_ids[i][batch.prompt_mask[i]].tolist()))
            rng = random.Random(f"{self.seed}/{iteration}/{rank}/{i}")
            row = {name: values[i] for name, values in batch.extras.items()}
            resets.append(partial(environment.reset, batch.prompts[i], row, rng))
        for i, (episode, outcome) in enumerate(zip(episodes, self._bounded(resets), strict=True)):
            try:
                value_of(outcome, _owner(episode), "reset", 0, batch.prompts[i], self.config.step_timeout)
            except EnvironmentFailure as failure:
                self._drop_or_raise(episode, failure)
        return episodes

    def _contexts(self, episodes: list[_Episode], batch: PromptBatch) -> tuple[Tensor, Tensor]:
        """Prompt plus everything so far of each episode, left padded (generation continues it)."""
        contexts = [episode.prompt + episode.tokens for episode in episodes]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.bool)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = True
        return ids.to(batch.prompt_ids.device), mask.to(batch.prompt_mask.device)

    def _reply(self, episode: _Episode, rollout: Rollout, row: int, turn: int) -> Turn:
        """Append the policy's reply (cut at the budget); what the environment is asked about."""
        keep = rollout.response_mask[row]
        reply = rollout.response_ids[row][keep].tolist()
        logprobs = rollout.engine_logprobs[row][keep].tolist() if rollout.engine_logprobs is not None else []
        room = self.config.max_tokens - len(episode.tokens)
        episode.truncated = len(reply) > room
        reply, logprobs = reply[:room], logprobs[:room]
        episode.ended = bool(rollout.ended[row]) and not episode.truncated
        self._append(episode, reply, True, logprobs)
        episode.turns, episode.last_reply = episode.turns + 1, len(reply)
        episode.cached = len(episode.tokens)  # a kept cache holds everything up to here
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        episode.transcript.append(text)
        episode.words.append(episode.environment.own_words(text))
        return Turn(turn, text, reply, episode.ended)

    def _answer(self, episode: _Episode, outcome: Outcome, turn: int, prompt: str) -> None:
        """The environment's checked answer: the turn's reward, whether it is done, its observation."""
        result = step_result(outcome, _owner(episode), turn, prompt, self.config.step_timeout)
        if result.reward is not None and episode.last_reply:  # on the reply's last token
            episode.rewards[len(episode.tokens) - 1] = result.reward
        episode.done = result.done or episode.truncated or turn + 1 >= self.config.max_turns
        if not episode.done and result.observation:
            text = self._observation_text(result.observation)
            observation = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            room = self.config.max_tokens - len(episode.tokens)
            episode.truncated = len(observation) >= room  # no room left for another reply
            episode.done = episode.truncated
            self._append(episode, observation[:room], False, [0.0] * min(room, len(observation)))
            episode.transcript.append(f"{OBSERVATION_OPEN}{_shown(result.observation)}{OBSERVATION_CLOSE}")

    def _observation_text(self, observation: str | dict[str, str]) -> str:
        """The text appended: the observation itself, or a chat message as the template writes it."""
        return observation if isinstance(observation, str) else self.render_message(observation)

    @staticmethod
    def _append(episode: _Episode, tokens: list[int], action: bool, logprobs: list[float]) -> None:
        episode.tokens += tokens
        episode.is_action += [action] * len(tokens)
        episode.engine_logprobs += logprobs if logprobs else [0.0] * len(tokens)

    def _rollout(self, episodes: list[_Episode], batch: PromptBatch) -> Rollout:
        """The episodes as one rollout: every turn and observation in the response region."""
        width = max(max(len(e.tokens) for e in episodes), 1)
        device = batch.prompt_ids.device
        ids = torch.full((len(episodes), width), self.pad_token_id, dtype=torch.long)
        action = torch.zeros((len(episodes), width), dtype=torch.bool)
        context = torch.zeros_like(action)
        # fp32 by choice, not the default dtype (the low one under a true-precision plugin)
        rewards = torch.zeros((len(episodes), width), dtype=torch.float32)
        logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)
        for row, e in enumerate(episodes):
            n = len(e.tokens)
            ids[row, :n] = torch.tensor(e.tokens, dtype=torch.long)
            is_action = torch.tensor(e.is_action, dtype=torch.bool)  # bool also when empty (a failed reset)
            action[row, :n] = is_action & (not e.failed)
            context[row, :n] = ~is_action
            logprobs[row, :n] = torch.tensor(e.engine_logprobs, dtype=torch.float32)
            for index, reward in e.rewards.items():
                rewards[row, index] = reward
        self.transcripts = ["".join(e.transcript) for e in episodes]
        self.own_words = [None if e.failed else " ".join(w for w in e.words if w) for e in episodes]
        self.last_stats = EpisodeStats(
            turns=torch.tensor([e.turns for e in episodes], device=device),
            tokens=torch.tensor([len(e.tokens) for e in episodes], device=device),
            truncated=torch.tensor([e.truncated for e in episodes], device=device),
            failed=torch.tensor([e.failed for e in episodes], device=device),
            timeouts=torch.tensor([e.failure == "timeout" for e in episodes], device=device),
            bad_rewards=torch.tensor([e.failure == "bad_reward" for e in episodes], device=device),
            # the tools' own counters, never an attribute of the user's environment that shares the name
            tool_calls=torch.tensor([tool_counts(e.environment)[0] for e in episodes], device=device),
            tool_errors=torch.tensor([tool_counts(e.environment)[1] for e in episodes], device=device),
        )
        return Rollout(
            batch.prompt_ids,
            batch.prompt_mask.bool(),
            ids.to(device),
            action.to(device),
            torch.tensor([e.ended for e in episodes], device=device),
            engine_logprobs=logprobs.to(device) if self._engine_logprobs else None,
            context_mask=context.to(device) if context.any() else None,
            turn_rewards=rewards.to(device) if any(e.rewards for e in episodes) else None,
        )


def _shown(observation: str | dict[str, str]) -> str:
    """An observation as the sample tables show it: the text, or ``role: content``."""
    return (
        observation
        if isinstance(observation, str)
        else f"{observation.get('role')}: {observation.get('content')}"
    )


def _owner(episode: _Episode) -> str:
    return type(episode.environment).__name__


def copy_for_an_episode(environment: Environment) -> Environment:
    """A deep copy of the configured environment, for one episode, its ``shared`` attributes the
    configured instance's own; one holding what cannot be copied (a lock, a client, a socket, an
    open file) is one line naming its class and what to do."""
    inner = environment.inner if isinstance(environment, ToolEnvironment) else None
    user = inner if inner is not None else environment
    memo: dict[int, Any] = {}
    for value in _shared_objects(user):
        memo[id(value)] = value  # deepcopy hands back what its memo holds: this very object
    if isinstance(environment, ToolEnvironment):  # a tool's object (a client's bound method): one for all
        for tool in environment.tools.values():
            owner = getattr(tool, "__self__", None)
            if owner is not None:
                memo[id(owner)] = owner
    try:
        return copy.deepcopy(environment, memo)
    except Exception as err:  # TypeError: cannot pickle '_thread.lock' object, copy.Error, ...
        tools_only = isinstance(environment, ToolEnvironment) and inner is None
        what = "model.tools: a tool's object" if tools_only else type(user).__name__
        raise UsageError(
            f"model.environment: {what} cannot be copied for each episode (copy.deepcopy "
            f"raised {type(err).__name__}: {err}): name the attribute in the class's `shared` tuple "
            "(one object for every episode) or create it in reset() (one per episode)"
        ) from err


def _shared_objects(user: Any) -> list[Any]:
    """The objects the environment's ``shared`` names (attribute names, a tuple or list of strings)."""
    names = getattr(type(user), "shared", ())
    if not isinstance(names, tuple | list) or not all(isinstance(name, str) for name in names):
        raise UsageError(
            f"model.environment: {type(user).__name__}.shared must be a tuple of attribute names "
            f"(strings), like ('client',); it is {names!r}"
        )
    return [getattr(user, name) for name in names if hasattr(user, name)]


def make_episode_runner(
    environment: Environment | Callable[..., StepResult] | None,
    tools: list[Any] | None,
    config: EpisodeConfig,
    tokenizer: Any,
    stop_token: str | None,
    seed: int,
    on_bad_reward: str = "error",
) -> EpisodeRunner | None:
    """The runner for ``model.environment`` and/or ``model.tools``; ``None`` (one reply per prompt,
    today's path) with neither."""
    if environment is not None and not hasattr(environment, "step") and callable(environment):
        environment = StepFunction(environment)
    if tools:
        environment = ToolEnvironment(
            tools, config.tool_format, tokenizer, stop_token, environment, config.tool_timeout
        )
    if environment is None:
        return None
    return EpisodeRunner(
        environment, config, tokenizer, tokenizer.pad_token_id, seed, stop_token, on_bad_reward
    )
