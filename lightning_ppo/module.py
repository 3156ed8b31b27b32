"""``PPOLightningModule``: one PPO iteration per ``training_step``, with manual optimization.

The step reads like the seed pseudocode: generate, score, build the experience, run the inner
PPO epochs, update the KL controller, log. Devices, precision, strategy and logging belong to
the Lightning ``Trainer``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from lightning_ppo.checkpoint import PPO_STATE_KEY, PPOState, newest_checkpoint, without_frozen
from lightning_ppo.config import EpisodeConfig, GenerationConfig, PPOConfig
from lightning_ppo.distributed.ranks import any_rank, no_backward_sync, over_ranks, seed_ranks_apart
from lightning_ppo.distributed.sharded_checkpoint import install_sharded_checkpointing
from lightning_ppo.distributed.sharding import (
    as_many_on_every_rank,
    gathered_for_generation,
    is_sharded,
    micro_batches_on_every_rank,
    reject_fsdp1,
    reshard,
    shard_if_model_parallel,
    uses_model_parallel,
)
from lightning_ppo.dropped_episodes import dropped_episodes, policy_answers, score_kept
from lightning_ppo.models.loading import load_tokenizer
from lightning_ppo.models.placement import LoadsWhereItRuns, keep_through_teardown
from lightning_ppo.models.roles import LoraSettings, Roles
from lightning_ppo.ppo import compiled_loss, optim
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.experience import Experience, make_experience, minibatch_rows
from lightning_ppo.ppo.kl import make_kl_controller
from lightning_ppo.ppo.microbatches import (
    MicroBatch,
    RowFacts,
    Share,
    cut_micro_batches,
    minibatch_stats,
    over_every_rank,
    plan_minibatch,
    weighted,
)
from lightning_ppo.ppo.optim import OptimizerStep, mean_grad_norms, prefer_fused, step_if_finite
from lightning_ppo.ppo.param_groups import CriticSettings, check_role_groups, role_groups
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.ppo.row_groups import forward_groups
from lightning_ppo.ppo.schedule import check_scheduler
from lightning_ppo.reward_setup import RewardSetup
from lightning_ppo.rewards import RewardLike, RunningMoments, ScoreInputs, check_scores
from lightning_ppo.rollout.ahead import (
    PENDING_KEY,
    EpisodeRecord,
    RolloutsAhead,
    Sampled,
    check_ahead,
    gather_objects,
    pending_of_rank,
    pipeline_for,
    say_untrained,
    to_saved,
)
from lightning_ppo.rollout.engines import (
    GenerationEngine,
    engine_for_trainer,
    engine_is_weights,
    engine_mismatch,
)
from lightning_ppo.rollout.episodes import Environment, StepResult, make_episode_runner
from lightning_ppo.rollout.fit_callbacks import fit_callbacks
from lightning_ppo.rollout.prompts import PromptBatch, PromptEndWarning
from lightning_ppo.rollout.sampling import SamplingSetup, generate
from lightning_ppo.rollout.tools import prompt_tools
from lightning_ppo.runs.ctrl_c import training_started
from lightning_ppo.runs.errors import RunStopped, UsageError
from lightning_ppo.runs.preflight import check_precision, check_sequence_fits, response_budget
from lightning_ppo.runs.quiet import silence_intended_warnings
from lightning_ppo.runs.resume import BuiltRate, built_rates, check_resumable, say_restored_rates
from lightning_ppo.runs.run_length import check_training_plan, explain_idle_resume
from lightning_ppo.runs.stop_iteration import StopIterationIsAnError, loops_name_hook_stops, no_silent_stop
from lightning_ppo.scoring import ACCURACY_COLUMN, Scorer, answer_accuracy
from lightning_ppo.watch.diversity import Diversity
from lightning_ppo.watch.guardrails import Guardrails, IterationView
from lightning_ppo.watch.metrics import HostView, TrailingMean, experience_metrics, score_metrics
from lightning_ppo.watch.samples import Samples


@dataclass
class ShapedScores:
    """One batch's scores as the reward returned them and as the update uses them (all (B,))."""

    raw: Tensor  # the reward's output; NaN/inf where dropped
    shaped: Tensor  # clipped and normalised if configured, else raw; 0 where dropped
    dropped: Tensor  # bool: non-finite scores left out of the update (``ppo.on_bad_reward: drop``)


@dataclass
class RolloutForwards:
    """No-grad forwards over a rollout (all (B, R), 0-padded past each response's end)."""

    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor  # zeros for critic-free estimators
    entropy: Tensor


class PPOLightningModule(LoadsWhereItRuns, LightningModule):
    """PPO (and GRPO, RLOO, REINFORCE++) for RLHF of a Hugging Face causal LM.

    Rewards: override :meth:`score` in a subclass, or configure ``reward_fn`` and/or ``reward_model``.

    Args:
        policy: Path or hub name of the causal LM to train.
        reward_fn: One reward or a list of them, by ``class_path`` (a ``RewardFunction``
            or a class with ``__call__``) or by import path (a plain function). Each is called as
            ``fn(prompts, completions, batch)``, or, written as TRL's reward functions are
            (``fn(prompts, completions, **kwargs)``), with TRL's keywords and the dataset's other
            columns (``lightning_ppo.rewards.RewardCall``, ``lightning_ppo.scoring``); it returns one
            number (or ``None``: not applicable) per completion, or is ``async``. As in TRL, an entry
            may also be a reward model: a path, or in Python a loaded ``PreTrainedModel``.
        reward_weights: Weights of the rewards (``reward_fn``'s in list order, then ``reward_model``,
            then ``reward_adapter``); default 1 each.
        reward_model: Path of an ``AutoModelForSequenceClassification`` (num_labels=1); the score
            is read at the last real token.
        reward_tokenizer: Tokenizer of the reward model (default: the one saved with it, else the
            policy's). With a vocabulary other than the policy's, completions are decoded and
            re-tokenised for it.
        reward_adapter: With ``lora``: a PEFT sequence-classification adapter trained on the policy's
            base, used as the reward on that same base (no second copy of the weights).
        reward_chat_template: Give the reward model each prompt and completion as a user/assistant
            chat in its tokenizer's chat template (always via text).
        value_model: The critic (only built for ``ppo.advantage_estimator: gae``): ``separate``, a
            model of its own; ``shared``, a scalar head on the policy's backbone (one forward gives
            log-probs and values, one optimizer trains both).
        value: Checkpoint a separate critic is initialised from (default: the reward model when it
            shares the policy's vocabulary, as InstructGPT and TRL do, else the policy).
        reference: Checkpoint of the frozen reference policy (default: the initial policy; with
            LoRA always the policy's base with the adapter disabled, no second copy).
        lora: Train LoRA adapters instead of the full policy (PEFT). One copy of the base weights
            then serves policy, reference and a shared critic.
        frozen_dtype: ``bf16``, ``fp16`` or ``fp32`` for frozen weights (reference, reward model,
            LoRA base); ``None``: fp32. Trained weights are fp32 under the Trainer's precision,
            whatever dtype the checkpoint was saved in.
        gradient_checkpointing: Recompute activations during the backward pass to save memory
            (generation runs in eval mode, with the KV cache).
        tokenizer: Tokenizer path (default: the policy's).
        ppo: PPO hyper-parameters.
        generation: Sampling settings for rollouts.
        environment: Multi-turn episodes: what answers the policy's turns, a class or a ``step(turn, row)``
            function (``lightning_ppo.rollout.episodes``).
        tools: Functions the policy may call in its turns (``lightning_ppo.rollout.tools``); multi-turn too.
        episode: Turns and token budget of multi-turn episodes (with ``environment``).
        optimizer: Optimizer over the policy and the critic (one for both). ``None``: AdamW at lr 1e-5,
            1e-4 with ``lora`` (``optim.default_optimizer``), not torch's 1e-3 that wrecks a pretrained LM.
        critic_optimizer: The critic's own settings (lr, weight_decay, betas...), as an optimizer of
            ``optimizer``'s class: the critic's parameters (the separate value model, or the shared value
            head) become a second param group of the one optimizer, with these settings
            (``lightning_ppo.ppo.param_groups``). ``None``: the critic trains as the policy does.
        lr_scheduler: Optional scheduler, stepped after every optimizer step.
        seed: Seed of the minibatch shuffling (the Trainer's ``seed_everything`` seeds sampling).
        trust_remote_code: Allow checkpoints to run their own code. Off unless you trust them.
    """

    def __init__(
        self,
        policy: str,
        reward_fn: RewardLike | list[RewardLike] | None = None,
        reward_weights: list[float] | None = None,
        reward_model: str | None = None,
        reward_tokenizer: str | None = None,
        reward_chat_template: bool = False,
        reward_adapter: str | None = None,
        value_model: str = "separate",
        value: str | None = None,
        reference: str | None = None,
        lora: LoraSettings | None = None,
        frozen_dtype: str | None = None,
        gradient_checkpointing: bool = False,
        tokenizer: str | None = None,
        ppo: PPOConfig = PPOConfig(),
        generation: GenerationConfig = GenerationConfig(),
        environment: Environment | Callable[..., StepResult] | None = None,
        tools: list[Callable] | None = None,
        episode: EpisodeConfig = EpisodeConfig(),
        optimizer: OptimizerCallable | None = None,
        critic_optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        # Frozen roles are left out of checkpoints, so loading one must not demand their keys.
        self.strict_loading = False
        scored_otherwise = environment is not None or bool(tools) or self._overrides_score
        rewards = RewardSetup.check(reward_fn, reward_weights, reward_model, reward_adapter, scored_otherwise)
        if critic_optimizer is not None and not ppo.uses_critic:
            raise UsageError(
                f"model.critic_optimizer must be null with ppo.advantage_estimator "
                f"{ppo.advantage_estimator!r}, which trains no critic"
            )
        self.critic_settings = CriticSettings.of(critic_optimizer) if critic_optimizer is not None else None
        self.reward_fns, self.reward_calls, self.reward_weights = rewards.fns, rewards.calls, rewards.weights
        self.save_hyperparameters(
            {
                "policy": policy,
                "reward_model": reward_model,
                "reward_weights": reward_weights,
                "value_model": value_model,
                "value": value,
                "reference": reference,
                "lora": asdict(lora) if lora is not None else None,
                "critic_optimizer": self.critic_settings and self.critic_settings.name,
                "policy_tokenizer": tokenizer or policy,
                "ppo": asdict(ppo),
                "generation": asdict(generation),
                "episode": asdict(episode) if environment is not None or tools else None,
                "seed": seed,
                "trust_remote_code": trust_remote_code,  # what export says when the policy needs it
            }
        )
        self.ppo, self.generation_config, self.seed = ppo, generation, seed
        self.policy_path = policy
        self._engine: GenerationEngine | None = None
        self._ahead: RolloutsAhead | None = None  # ppo.max_staleness > 0 (lightning_ppo.rollout.ahead)
        self._restored_pending: list[dict[str, Any]] = []  # a checkpoint's, until sampling starts
        self._left_running: RolloutsAhead | None = None  # a failed fit's, its job left to end
        self._compiled_loss: Callable | None = None  # ppo_loss under torch.compile (ppo.torch_compile)
        self.optimizer_factory = optimizer or partial(optim.default_optimizer, lora=lora is not None)
        self.scheduler_factory = lr_scheduler
        self._built_rates: list[BuiltRate] | None = None  # by configure_optimizers (the package's)
        self.tokenizer = load_tokenizer(tokenizer or policy, trust_remote_code)
        sampling = SamplingSetup.of(generation, self.tokenizer)
        self.stop_token_id, self.suppressed_ids = sampling.stop_token_id, sampling.suppressed_ids
        self.hf_generation, self.hf_eval_generation = sampling.hf_generation, sampling.hf_eval_generation
        self.episode_runner = make_episode_runner(
            environment, tools, episode, self.tokenizer, generation.stop_token, seed, ppo.on_bad_reward
        )
        # what the data module writes into the prompts about the tools (rollout/tools.PromptTools)
        self.prompt_tools = prompt_tools(self.episode_runner and self.episode_runner.environment)
        # Skeletons where they can be: configure_model reads their weights on the device they run on.
        with self.building_roles():
            self.reward_model = rewards.load_model(
                self.tokenizer, reward_tokenizer, reward_chat_template, trust_remote_code, frozen_dtype
            )
            for name, model in rewards.load_listed(self.tokenizer, trust_remote_code, frozen_dtype).items():
                self.add_module(name, model)  # children, as reward_model: moved, frozen, sharded
            self.roles = Roles(
                policy,
                reference=reference,
                value=value or rewards.critic_source(policy, self.reward_model),
                value_model=value_model if ppo.uses_critic else None,
                lora=lora,
                frozen_dtype=frozen_dtype,
                gradient_checkpointing=gradient_checkpointing,
                trust_remote_code=trust_remote_code,
            )
        self.reward_adapter = rewards.load_adapter(lambda: self.roles.policy, lora)
        self.kl_ctl = make_kl_controller(
            ppo.kl_coef, ppo.kl_target, ppo.kl_horizon, ppo.kl_coef_min, ppo.kl_coef_max
        )
        self.score_moments = RunningMoments()
        self.smoothed_score = TrailingMean()
        self.iteration = 0
        self.episodes = 0
        self.last_samples: Samples | None = None
        # The batch, rollout and weights version the last training step trained on (None: it trained
        # none): what a callback checks the sampling against (lightning_ppo.selfcheck.recorder).
        self.last_rollout: Sampled | None = None
        self.consecutive_skips = 0  # optimizer steps in a row skipped for NaN/inf gradients
        self.dropped_in_a_row = 0  # iterations in a row whose every sample was dropped (no steps at all)
        self.guardrails: Guardrails | None = None
        budget = episode.max_tokens if self.episode_runner is not None else generation.max_new_tokens
        self.loss_aggregation = F.Aggregation(ppo.loss_aggregation, budget)  # constant: the length budget
        self.prompt_end = PromptEndWarning(self.tokenizer, self.stop_token_id)
        self.scorer = Scorer()

    @property
    def _overrides_score(self) -> bool:
        """Whether a subclass scores by its own :meth:`score` (it then needs no configured reward)."""
        return type(self).score is not PPOLightningModule.score

    def setup(self, stage: str) -> None:
        reject_fsdp1(self.trainer.strategy)
        check_precision(self.trainer.precision)
        install_sharded_checkpointing(self.trainer.strategy)  # before a resume loads a folder
        keep_through_teardown(self.trainer.strategy)  # the roles and optimizer state stay on the device
        check_ahead(
            self.ppo.max_staleness, self.generation_config, uses_model_parallel(self.trainer.strategy)
        )
        silence_intended_warnings()  # e.g. the frozen roles are in eval mode on purpose
        loops_name_hook_stops(self.trainer)  # a hook's StopIteration is its error, not the data's end
        # Before the first rollout: past the model's positions generation fails with an IndexError.
        # response_budget reads a config's settings: an episode runner stands for environment or tools.
        budget_field, budget = response_budget({**self.hparams, "environment": self.episode_runner})
        max_prompt_length = getattr(self.trainer.datamodule, "max_prompt_length", None)
        check_sequence_fits(self.policy.config, "model.policy", max_prompt_length, budget, budget_field)
        if self.episode_runner is not None and self.generation_config.engine == "hf":  # keep_cache's own
            self.episode_runner.check_model(self.policy.config)
        seed_ranks_apart(self.trainer)
        if stage == "fit":  # a previous fit's pipeline (one that raised) holds batches of its own
            self.end_sampling_ahead(wait=True)
            self._restored_pending = []  # a checkpoint loaded next (--ckpt_path) sets them

    def on_train_start(self) -> None:
        check_training_plan(self.trainer, self.ppo)
        # the optimizer state is the checkpoint's now; an override of configure_optimizers built
        # rates the package cannot name (_built_rates None)
        if self.trainer.ckpt_path is not None and self._built_rates is not None:
            groups = self.trainer.optimizers[0].param_groups
            say_restored_rates(self._built_rates, groups, self.lr_fields, self.lr_schedulers())
        training_started()  # a Ctrl-C from now on may find checkpoints written (lightning_ppo.runs.ctrl_c)

    def on_fit_end(self) -> None:
        explain_idle_resume(self.trainer, getattr(self, "_resumed_at", None), self.iteration)
        self.end_sampling_ahead(wait=True)
        say_untrained(len(self._restored_pending), self.ppo.max_staleness)

    def end_sampling_ahead(self, wait: bool) -> None:
        """Stop sampling ahead (``ppo.max_staleness``); the batches not trained stay as a checkpoint
        keeps them, for a ``trainer.save_checkpoint`` after ``fit`` (a new ``fit`` starts afresh)."""
        if self._ahead is not None:
            self._ahead.close(wait)
            self._restored_pending = [to_saved(b) for b in self._ahead.pending()]
            self._ahead, self._left_running = None, None if wait else self._ahead
        elif wait and self._left_running is not None:  # a failed fit's job ends before a new fit starts
            self._left_running.close(wait=True)
            self._left_running = None

    def configure_callbacks(self) -> list[Callback]:
        return fit_callbacks()  # a failed fit leaves no pipeline for the next one; no open connections

    def configure_model(self) -> None:
        shard_if_model_parallel(self, self.trainer.strategy, str(self.trainer.precision))  # FSDP2, once
        # The roles built as skeletons read their weights onto the device they run on (FSDP2: each rank
        # its shards), in their final dtype (lightning_ppo.models.placement).
        self.load_weights(self.trainer.strategy.root_device)

    # ----------------------------------------------------------------- the PPO iteration
    @no_silent_stop  # Lightning takes a step's StopIteration for the end of the data
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self.ppo.check_batch_size(len(batch))
        sampled = self.last_rollout = self.sample(batch)
        if sampled is None:  # ppo.max_staleness > 0: the first batches only start sampling
            return
        batch, rollout = sampled.batch, sampled.rollout
        completions = self.decode_responses(rollout)
        failed = dropped_episodes(sampled, self.device)  # the environment's: never scored
        if sampled.episodes is not None and self.nothing_to_learn(failed):
            self._skip_iteration(len(batch), sampled.episodes)
            return
        scores = self.shape_scores(score_kept(self, batch, rollout, completions, failed), rollout, failed)
        if self.nothing_to_learn(scores.dropped):
            self._skip_iteration(len(batch))
            return
        forwards = self.rollout_forwards(rollout)
        kl_coef = self.kl_ctl.value
        exp = self.experience(rollout, forwards, scores.shaped, kl_coef)
        stats, stepped = self.ppo_update(exp)
        self.iteration += 1
        self.episodes += len(batch) * self.trainer.world_size
        reduce = self.sum_over_ranks
        stats.update(
            experience_metrics(exp, forwards.entropy, rollout.ended, kl_coef, self.roles.has_critic, reduce)
        )
        raw = scores.raw if rollout.turn_rewards is None else scores.raw + rollout.turn_rewards.sum(1)
        shaping = self.ppo.shapes_scores
        stats.update(score_metrics(raw, scores.shaped, scores.dropped, shaping, reduce, failed))
        stats.update(engine_mismatch(self.generation_config, rollout, forwards.logprobs))
        if self.ppo.max_staleness > 0:
            stats["async/staleness"] = torch.tensor(
                float(self.iteration - 1 - sampled.version), device=self.device
            )
        if sampled.episodes is not None:  # the runner's counts of this batch, not of one sampled since
            stats.update(sampled.episodes.stats.metrics(reduce))
        answers = policy_answers(self._trainer, batch.prompts, completions, sampled.episodes)  # every rank's
        diversity = Diversity.of(answers.prompts, answers.completions)  # text, on the host: no device read
        stats.update(diversity.on(self.device))
        # the iteration's one host read: what the host decides on and what it logs; the guardrails
        # judge the spread of every reward the update used (the shaped scores and an environment's)
        used, kept = exp.scores, ~scores.dropped
        host = HostView.read(
            stats, stepped, raw, exp.kl.sum(1), used, kept, self.mean_over_ranks, reduce, rollout.turn_rewards
        )
        self._count_skips(host.stepped)
        logged = host.logged
        logged["objective/scores_smoothed"] = self.smoothed_score.add(host.stats["objective/scores"])
        logged["kl_coef"] = kl_coef
        self.kl_ctl.update(host.stats["objective/kl"], len(batch) * self.trainer.world_size)
        self.heed_guardrails(answers.completions, host, diversity)
        self.log_stats(logged, len(batch))
        shown = completions if sampled.episodes is None else sampled.episodes.transcripts
        self.last_samples = Samples(batch.prompts, shown, host.scores, host.kl, self.scorer.columns)

    def experience(
        self, rollout: Rollout, forwards: RolloutForwards, scores: Tensor, kl_coef: float
    ) -> Experience:
        """The rollout's per-token rewards, advantages and returns; whitened over every rank's tokens."""
        return make_experience(
            rollout,
            forwards.logprobs,
            forwards.ref_logprobs,
            forwards.values,
            scores,
            kl_coef,
            self.ppo,
            engine_is_weights(self.generation_config, rollout, forwards.logprobs, self.ppo.max_staleness),
            self.sum_over_ranks,
        )

    def heed_guardrails(self, completions: list[str], host: HostView, diversity: Diversity) -> None:
        """The guardrails' one-time warnings (lightning_ppo.watch.guardrails), spoken by rank 0."""
        group = self.optimizers().param_groups[0]  # the configured rate (a scheduler's base), as resumed
        lr = float(group.get("initial_lr", group["lr"]))
        if self.guardrails is None:  # else restored with a checkpoint (checkpoint.PPOState)
            self.guardrails = Guardrails(self.ppo, lr)
        self.guardrails.lr = lr
        self.guardrails.heed(IterationView.of(self.iteration, completions, host, self.kl_ctl, diversity))

    @no_silent_stop
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        """Greedy (or sampled, ``generation.eval_do_sample``) responses to held-out prompts, scored."""
        with gathered_for_generation(self.policy, self.generation_config.gather_for_generation):
            cache = self.generation_config.cache_implementation
            rollout = generate(
                self.policy, batch.prompt_ids, batch.prompt_mask, self.hf_eval_generation, cache
            )
        completions = self.decode_responses(rollout)
        scores = self.call_score(
            batch.prompts, completions, ScoreInputs(batch.extras, rollout, batch.messages)
        )
        scores = check_scores(scores, len(batch), self.reward_label, self.device, allow_nonfinite=True)
        finite = torch.isfinite(scores)
        self.log("eval/scores", scores[finite].mean(), batch_size=int(finite.sum()), sync_dist=True)
        correct = self.scorer.columns.get(ACCURACY_COLUMN)  # a reward that knows right from wrong
        if correct is not None:  # greedy pass@1, as users report accuracy
            accuracy = answer_accuracy(correct, len(batch))
            self.log("eval/accuracy", accuracy, batch_size=len(batch), sync_dist=True)
        self.log(
            "eval/length_mean", rollout.response_lengths.float().mean(), batch_size=len(batch), sync_dist=True
        )
        # The same x-axis as the training rows: a CSV eval row otherwise has an empty iteration.
        self.log("iteration", float(self.iteration), batch_size=len(batch), sync_dist=True)

    @property
    def sum_over_ranks(self) -> F.Reduce | None:
        """Sums a tensor over the data-parallel ranks (the strategy's all-reduce); ``None`` in one
        process. What steers training (whitening, score moments, the KL controller, skipping) uses it."""
        return over_ranks(self._trainer, "sum")

    @property
    def mean_over_ranks(self) -> F.Reduce | None:
        """Averages a tensor over the ranks, as ``log(sync_dist=True)`` averages a logged value."""
        return over_ranks(self._trainer, "mean")

    def nothing_to_learn(self, dropped: Tensor) -> bool:
        """Whether every sample of every rank was dropped. Decided together: a rank that skipped alone
        would leave the others waiting in the update's collectives. A rank with nothing of its own
        to learn still runs the update (its masks are empty, its gradients zero)."""
        kept = (~dropped).sum().float()
        if self.sum_over_ranks is not None:
            kept = self.sum_over_ranks(kept)
        return bool(kept == 0)

    def _skip_iteration(self, batch_size: int, episodes: EpisodeRecord | None = None) -> None:
        """Every sample of every rank's batch was dropped, each score NaN/inf or, with ``episodes``,
        each episode by its environment: nothing to learn from, count it."""
        self.iteration += 1
        self.dropped_in_a_row += 1
        limit = f"(ppo.max_consecutive_skips = {self.ppo.max_consecutive_skips}): stopping."
        if self.dropped_in_a_row >= self.ppo.max_consecutive_skips and episodes is not None:
            raise RunStopped(
                f"every episode was dropped for {self.dropped_in_a_row} iterations in a row {limit} "
                f"{newest_checkpoint(self._trainer)} The environment raised, timed out or gave NaN/inf "
                "rewards (episode/env_errors, episode/timeouts, episode/bad_rewards): set "
                "episode.on_error: error to see why"
            )
        if self.dropped_in_a_row >= self.ppo.max_consecutive_skips:
            raise RunStopped(
                f"the reward {self.reward_label!r} returned only NaN/inf for {self.dropped_in_a_row} "
                f"iterations in a row {limit} {newest_checkpoint(self._trainer)}"
            )
        if episodes is None:
            self.log("reward/dropped", float(batch_size), on_step=True, batch_size=batch_size)
            return
        counts = {name: float(value) for name, value in episodes.stats.metrics(self.sum_over_ranks).items()}
        self.log_dict(counts, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=False)

    def sample(self, batch: PromptBatch) -> Sampled | None:
        """The rollout to train on: this batch's, sampled now with the weights that train on it
        (``ppo.max_staleness`` 0), or the oldest batch's, sampled ahead while earlier updates ran
        (lightning_ppo.rollout.ahead); None while the first batches only start sampling."""
        if self.ppo.max_staleness == 0:
            batch = batch.repeat_interleave(self.ppo.num_generations)
            return Sampled(batch, self.generate(batch), self.iteration, EpisodeRecord.of(self.episode_runner))
        if self._ahead is None:
            self._ahead = pipeline_for(self)
        return self._ahead.next(batch, self.iteration)

    def generate(self, batch: PromptBatch) -> Rollout:
        """Sample one response (or, with an environment, one episode) per (repeated) prompt."""
        self.prompt_end.check(batch)
        self.engine.sync_weights(self.policy)
        # FSDP2: one all-gather per block, not per token (unless generation.gather_for_generation is off)
        with gathered_for_generation(self.policy, self.generation_config.gather_for_generation):
            return self._sample(batch)

    def _sample(self, batch: PromptBatch) -> Rollout:
        """One engine call, or the episode runner's one per turn."""
        if self.episode_runner is not None:  # multi-turn: one generate per turn, the environment between
            # Every rank takes each turn while any rank has an episode running (FSDP2 gathers per forward).
            on_any_rank = any_rank(self._trainer)
            return self.episode_runner.run(self.engine, batch, self.iteration, self.global_rank, on_any_rank)
        return self.engine.generate(batch.prompt_ids, batch.prompt_mask)

    @property
    def engine(self) -> GenerationEngine:
        """The rollout's generation engine (``generation.engine``), built on first use: a vLLM
        engine needs the world size, known only once the Trainer runs."""
        if self._engine is None:
            self._engine = engine_for_trainer(
                self._trainer,
                self.generation_config,
                self.hf_generation,
                self.policy_path,
                self.seed,
                self.policy,
                self.tokenizer,
            )
        return self._engine

    def decode_responses(self, rollout: Rollout) -> list[str]:
        """Response text without the stop token or padding (a multi-turn episode: every turn and
        observation after the prompt)."""
        return self.tokenizer.batch_decode(rollout.episode_token_ids(), skip_special_tokens=True)

    def score(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor | list[float]:
        """One score per completion: the weighted sum of the configured rewards. Override for your own.

        Args:
            prompts: Prompt text as the policy saw it (after the chat template; a prompt cut to
                ``data.max_prompt_length`` tokens is the text of the tokens kept).
            completions: Sampled response text, without the stop token.
            batch: The dataset's extra columns (``batch.extras``), the token ids (``batch.rollout``)
                and, for conversational data, the prompts' messages (``batch.messages``).
        """
        return self.scorer.score(self, prompts, completions, batch)

    def call_score(
        self, prompts: list[str], completions: list[str], batch: ScoreInputs
    ) -> Tensor | list[float]:
        """:meth:`score`, where a ``StopIteration`` (an override's ``next()`` over no match) is an error
        naming it, not the end of the data Lightning would take it for (runs/stop_iteration)."""
        with StopIterationIsAnError(f"{type(self).__name__}.score"):
            return self.score(prompts, completions, batch)

    def shape_scores(self, scores: Any, rollout: Rollout, failed: Tensor | None = None) -> ShapedScores:
        """Validate, drop non-finite scores (if configured), clip and normalise.

        A dropped sample keeps shaped score 0 and its response mask is cleared, so it contributes
        to no loss and no statistic. The raw scores stay as they were, for logging. ``failed``: (B,)
        episodes their environment dropped; ``scores`` are then the other rows' (``score_kept``),
        and a failed row's raw score is NaN.
        """
        drop = self.ppo.on_bad_reward == "drop"  # rows no reward scored are dropped in any case
        kept = None if failed is None else (~failed).nonzero().squeeze(1)
        rows = len(rollout.response_ids) if kept is None else len(kept)
        raw = self.scorer.check_total(scores, rows, self.reward_label, self.device, drop)
        if kept is not None:  # back in the batch's rows
            raw = raw.new_full(failed.shape, torch.nan).index_copy(0, kept.to(raw.device), raw)
        dropped = ~torch.isfinite(raw)
        shaped = torch.where(dropped, torch.zeros_like(raw), raw)
        rollout.response_mask &= ~dropped[:, None]
        if self.ppo.score_clip is not None:
            shaped = shaped.clamp(-self.ppo.score_clip, self.ppo.score_clip)
        if self.ppo.score_norm:
            self.score_moments.update(shaped[~dropped], self.sum_over_ranks)
            shaped = torch.where(dropped, shaped, self.score_moments.normalize(shaped))
        return ShapedScores(raw, shaped, dropped)

    @property
    def reward_label(self) -> str:
        """The reward's name in error messages."""
        if self._overrides_score:
            return f"{type(self).__name__}.score"
        names = [call.name for call in self.reward_calls] + ["reward_model"] * (self.reward_model is not None)
        return " + ".join(names)

    @torch.no_grad()
    def rollout_forwards(self, rollout: Rollout) -> RolloutForwards:
        """Log-probs, reference log-probs, values and entropy of the sampled responses, computed for
        groups of similar-length rows, each without the columns that are padding in all its rows."""
        ids, mask, pos = rollout.input_ids, rollout.attention_mask, rollout.position_ids
        split, sharded = rollout.prompt_ids.shape[1], is_sharded(self)
        # fp32 by choice: under a true-precision plugin (bf16-true) the default dtype is the low one,
        # and the log-probs written here are fp32 whatever the weights' dtype
        out = torch.zeros(4, *rollout.response_ids.shape, dtype=torch.float32, device=ids.device)
        groups = forward_groups(mask, split, self.generation_config.forward_chunk_size)
        groups = as_many_on_every_rank(groups, split, ids.device, sharded)
        for group in groups:
            rows, cols, width = group.rows.to(ids.device), group.columns(split), group.after
            tokens = rollout.response_ids[rows, :width]
            inputs = ids[rows, cols], mask[rows, cols], pos[rows, cols]
            logits, values = self.roles.policy_forward(*inputs, width)
            logprobs = self.token_logprobs(logits, tokens)
            ref_logprobs = self.token_logprobs(self.roles.reference_logits(*inputs, width), tokens)
            values = torch.zeros_like(logprobs) if values is None else values
            if not group.idle:
                out[:, rows, :width] = torch.stack(
                    [logprobs, ref_logprobs, values, self.token_entropy(logits)]
                )
        logprobs, ref_logprobs, values, entropy = out.masked_fill(~rollout.response_mask, 0.0)
        if sharded:
            reshard(self)  # the frozen roles' gathered weights, before the PPO epochs
        return RolloutForwards(logprobs, ref_logprobs, values, entropy)

    def token_logprobs(self, logits: Tensor, tokens: Tensor) -> Tensor:
        """Log-probs under the distribution sampling used: same temperature, same suppressed tokens.

        The reference is read under the same mask, so the KL starts at 0 rather than at the
        reference's probability of the suppressed tokens.
        """
        return F.logprobs_from_logits(logits, tokens, self.generation_config.temperature, self.suppressed_ids)

    def token_entropy(self, logits: Tensor) -> Tensor:
        """Per-token entropy of the sampling distribution (temperature, suppressed tokens)."""
        return F.entropy_from_logits(logits, self.generation_config.temperature, self.suppressed_ids)

    @property
    def policy(self) -> torch.nn.Module:
        """The trained causal LM (a ``PeftModel`` with LoRA)."""
        return self.roles.policy

    @property
    def ref_policy(self) -> torch.nn.Module | None:
        """The frozen reference copy; ``None`` with LoRA, where the reference is the adapter-free base."""
        return self.roles.ref_policy

    @property
    def value_model(self) -> torch.nn.Module | None:
        """The separate critic, or ``None`` (shared head, or a critic-free estimator)."""
        return self.roles.value_model

    # ----------------------------------------------------------------- the inner PPO epochs
    def ppo_update(self, exp: Experience) -> tuple[dict[str, Tensor], Tensor]:
        """``ppo_epochs`` passes of shuffled minibatches; one optimizer step per minibatch. Returns the
        statistics (means over the minibatches) and whether each step was taken, all on the device."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        history: list[dict[str, Tensor]] = []
        steps: list[OptimizerStep] = []
        with self.roles.updating():  # training mode: HF checkpoints blocks only in it (dropout is off)
            for micro_batches in cut_micro_batches(exp, self.plan_update(exp)):
                history.append(self.train_minibatch(micro_batches))
                steps.append(self._step_if_finite(optimizer))
                optimizer.zero_grad(set_to_none=True)
                # The schedule counts attempted steps, so it does not depend on which were skipped.
                if scheduler is not None:
                    scheduler.step()
        stats = {key: torch.stack([h[key] for h in history]).mean() for key in history[0]}
        flags = torch.stack([step.stepped for step in steps])
        stats["train/skipped_updates"] = (~flags).sum().float()
        norms = mean_grad_norms(torch.stack([step.grad_norms for step in steps]), flags)
        names = ("train/grad_norm",) if len(norms) == 1 else ("policy/grad_norm", "val/grad_norm")
        stats.update(zip(names, norms, strict=True))
        return stats, flags

    def plan_update(self, exp: Experience) -> list[list[MicroBatch]]:
        """Every minibatch's micro-batches (trimmed, with shares), planned on the host from one read
        of the rows' lengths: no host sync between the minibatches of the update."""
        generator = torch.Generator().manual_seed(self.seed + self.iteration)
        rows = minibatch_rows(len(exp), self.ppo.num_minibatches, generator, epochs=self.ppo.ppo_epochs)
        split = self.ppo.gradient_accumulation_steps, self.ppo.micro_batch_tokens, is_sharded(self)
        facts = RowFacts.read(exp)  # the update's one host read
        plan = [plan_minibatch(facts, r, *split) for r in rows]
        # shares of the global minibatch: DDP's average of the ranks' gradients is then its mean
        plan = over_every_rank(plan, facts, rows, self.sum_over_ranks, self.trainer.world_size, self.device)
        return micro_batches_on_every_rank(plan, facts, rows, self.device, split[-1])

    def train_minibatch(self, micro_batches: list[tuple[Experience, Share]]) -> dict[str, Tensor]:
        """Forward and backward of each micro-batch, accumulating its share of the minibatch's
        gradient; the minibatch's statistics."""
        parts = []
        for i, (micro, share) in enumerate(micro_batches):
            # Under DDP (FSDP2) only the last micro-batch of a minibatch all-reduces
            # (reduce-scatters) gradients.
            last = i == len(micro_batches) - 1
            with nullcontext() if last else no_backward_sync(self, self.trainer.strategy):
                loss, stats = self.loss_pass(micro, share)
                self.manual_backward(loss)
            if not share.idle:
                parts.append((stats, share))
        return minibatch_stats(parts, self.loss_aggregation.mode)

    @property
    def loss_pass(self) -> Callable[[Experience, Share], tuple[Tensor, dict[str, Tensor]]]:
        """:meth:`ppo_loss`, under ``torch.compile`` with ``ppo.torch_compile`` (ppo.compiled_loss)."""
        if self._compiled_loss is None and self.ppo.torch_compile:
            self._compiled_loss = compiled_loss.for_module(self)
        return self._compiled_loss or self.ppo_loss

    def _step_if_finite(self, optimizer: Any) -> OptimizerStep:
        """Clip, then step unless a gradient is NaN/inf; whether it stepped (a device bool) and the
        gradient norms. Gradients are already all-reduced here, so every rank takes the same decision."""
        if self._grad_scaler is not None:  # 16-mixed: the grad scaler skips non-finite steps itself,
            optimizer.step()  # and on_before_optimizer_step has read whether it would, and clipped
            return OptimizerStep(~self._scaler_skips.to(self.device), self._scaled_norms)
        return step_if_finite(optimizer, self.ppo.clip_limits)

    def _count_skips(self, stepped: list[bool]) -> None:
        """Track skipped steps in a row across iterations; stop after ``max_consecutive_skips``. An
        iteration that trained ends a streak of all-dropped ones (counted apart: no step in them)."""
        self.dropped_in_a_row = 0
        for ok in stepped:
            self.consecutive_skips = 0 if ok else self.consecutive_skips + 1
            if self.consecutive_skips >= self.ppo.max_consecutive_skips:
                raise RunStopped(
                    f"{self.consecutive_skips} optimizer steps in a row had NaN/inf gradients "
                    f"(ppo.max_consecutive_skips = {self.ppo.max_consecutive_skips}): stopping. "
                    f"{newest_checkpoint(self._trainer)} Check the learning rate, the reward scale "
                    "and the precision."
                )

    def ppo_loss(
        self, mb: Experience, share: Share = Share(), kl_coef: float | Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss (+ vf_coef x value loss, + kl_coef x KL, - entropy_coef x entropy), each
        term weighed by its ``share`` of the minibatch (ppo.microbatches); ``kl_coef``: ``kl_ctl.value``."""
        length = mb.response_ids.shape[1]
        mask = F.TokenMask.of(mb.response_mask)  # shared by every mean below
        logits, values = self.roles.policy_forward(mb.input_ids, mb.attention_mask, mb.position_ids, length)
        logprobs = self.token_logprobs(logits, mb.response_ids)
        clip, aggregate = self.ppo.clip_bounds, self.loss_aggregation
        pg = F.policy_loss(
            logprobs, mb.logprobs, mb.advantages, mask, clip, self.ppo.dual_clip, mb.is_weights, aggregate
        )
        policy_share = share.of_policy_term(aggregate.mode)
        loss = weighted(pg.loss, policy_share)
        stats = {
            "policy/approxkl_avg": pg.approx_kl,
            "policy/clipfrac_avg": pg.clipfrac,
            "loss/policy_avg": pg.loss.detach(),
            "val/ratio": pg.ratio,
        }
        if self.ppo.entropy_coef > 0:
            # A vocabulary-wide softmax per token: only paid for when it is a loss term
            # (objective/entropy reports the rollout policy's entropy every iteration anyway).
            entropy = mask.mean(self.token_entropy(logits))
            loss = loss - weighted(self.ppo.entropy_coef * entropy, share.tokens)
            stats["policy/entropy_avg"] = entropy.detach()
        if self.ppo.kl_placement == "loss":
            # masked inside: a suppressed pad token's log-prob is -inf on padding (F.masked_log_ratio)
            kl = aggregate(F.kl_penalty(logprobs, mb.ref_logprobs, self.ppo.kl_estimator, mask), mask)
            loss = loss + weighted((self.kl_ctl.value if kl_coef is None else kl_coef) * kl, policy_share)
            stats["loss/kl_avg"] = kl.detach()
        if values is not None:
            vf = F.value_loss(values, mb.values, mb.returns, mask, self.ppo.value_clip_range)
            loss = loss + weighted(self.ppo.vf_coef * vf.loss, share.tokens)
            stats["loss/value_avg"] = vf.loss.detach()
            stats["val/clipfrac_avg"] = vf.clipfrac
        return loss, stats

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Under 16-mixed the precision plugin calls this between backward and step: the gradients are
        # unscaled (for a fused Adam too), so the clipped norm is real; without a grad scaler
        # _step_if_finite has clipped already.
        if self._grad_scaler is not None:
            self._scaler_skips = optim.scaler_will_skip(self._grad_scaler, optimizer)
            self._scaled_norms = optim.clip_per_role(optimizer, self.ppo.clip_limits)

    @property
    def _grad_scaler(self) -> Any:
        """The precision plugin's grad scaler (``16-mixed``), else ``None``."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    # ----------------------------------------------------------------- logging
    def log_stats(self, stats: dict[str, float], batch_size: int) -> None:
        # Plain floats, already averaged over the ranks where they differ (HostView: one collective
        # for all, not one per value) and the same on every rank: nothing left to sync.
        groups = self.optimizers().param_groups
        stats["lr"] = float(groups[0]["lr"])  # the policy's
        if self.per_role_groups:
            stats["lr_critic"] = float(groups[1]["lr"])
        stats["episode"] = float(self.episodes)
        stats["iteration"] = float(self.iteration)
        progress = {"objective/scores", "objective/kl"}
        shown = {k: v for k, v in stats.items() if k in progress}
        rest = {k: v for k, v in stats.items() if k not in progress}
        self.log_dict(
            shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=False
        )
        self.log_dict(rest, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=False)

    # ----------------------------------------------------------------- optimizers, checkpoints
    @property
    def per_role_groups(self) -> bool:
        """Whether the critic has a param group of its own (lightning_ppo.ppo.param_groups)."""
        return self.critic_settings is not None or self.ppo.critic_max_grad_norm is not None

    @property
    def lr_fields(self) -> list[str]:
        """The config field of each param group's learning rate."""
        policy = "model.optimizer.init_args.lr"
        if not self.per_role_groups:
            return [policy]
        return [policy, policy if self.critic_settings is None else "model.critic_optimizer.init_args.lr"]

    def configure_optimizers(self) -> Any:
        params: list[Any] = [p for p in self.parameters() if p.requires_grad]
        if self.per_role_groups:
            params = role_groups(params, self.roles.critic_parameters(), self.critic_settings)
        try:
            optimizer = self.optimizer_factory(params)
        except ValueError as err:  # torch checks lr, betas, eps, weight_decay... in the constructor
            raise UsageError(f"model.optimizer: {err}") from err
        if self.per_role_groups:
            check_role_groups(optimizer, self.critic_settings)
        prefer_fused(optimizer)
        configured = [float(group["lr"]) for group in optimizer.param_groups]
        scheduler = None if self.scheduler_factory is None else self.scheduler_factory(optimizer)
        check_scheduler(scheduler)  # ppo_update steps it after every optimizer step, with no metric
        self._built_rates = built_rates(optimizer.param_groups, configured, scheduler)  # before a restore
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Frozen weights (reference, reward model, a LoRA base) are reloaded from their own
        # checkpoints when the run resumes: saving them would only copy what is on disk already.
        # A sharded (FSDP2) state dict is the strategy's: distributed/sharded_checkpoint's holds the
        # trained weights only and loads without the others (Lightning's own load asks for every key).
        if not is_sharded(self):
            checkpoint["state_dict"] = without_frozen(checkpoint["state_dict"], self)
        checkpoint[PPO_STATE_KEY] = PPOState.of(self).to_dict()
        if self.ppo.max_staleness > 0:  # every rank's batches handed in and not trained yet
            mine = [to_saved(b) for b in self._ahead.pending()] if self._ahead else self._restored_pending
            checkpoint[PENDING_KEY] = gather_objects(self._trainer, mine)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trained = without_frozen(self.state_dict(), self)
        check_resumable(checkpoint, dict(self.hparams), trained, default_hparams(type(self)))
        PPOState.from_dict(checkpoint.get(PPO_STATE_KEY, {})).restore(self)
        saved_copies = checkpoint.get("hyper_parameters", {}).get("ppo", {}).get("num_generations", 1)
        self._restored_pending = pending_of_rank(
            checkpoint.get(PENDING_KEY), self._trainer, self.ppo.max_staleness, saved_copies
        )
        self._resumed_at = self.iteration


# The settings a checkpoint written before an option existed ran with: that option's default.
# Nested like the saved hyper-parameters, for the options whose default is a plain value.
def default_hparams(module_class: type) -> dict[str, Any]:
    """What ``save_hyperparameters`` records for a module built with every default."""
    defaults = {
        name: param.default
        for name, param in inspect.signature(module_class.__init__).parameters.items()
        if param.default is not inspect.Parameter.empty and isinstance(param.default, bool | int | str)
    }
    return {**defaults, "ppo": asdict(PPOConfig()), "generation": asdict(GenerationConfig())}
