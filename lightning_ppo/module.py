"""``PPOLightningModule``: one PPO iteration per ``training_step``, with manual optimization.

The step reads like the seed pseudocode: generate, score, build the experience, run the inner
PPO epochs, update the KL controller, log. Devices, precision, strategy and logging belong to
the Lightning ``Trainer``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_ppo import functional as F
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.data import PromptBatch
from lightning_ppo.experience import Experience, make_experience
from lightning_ppo.kl import make_kl_controller
from lightning_ppo.models import ValueModel, freeze, load_causal_lm, response_logits
from lightning_ppo.rewards import RewardFunction, RewardModel, ScoreInputs, check_scores
from lightning_ppo.rollout import Rollout, generate, hf_generation_config


@dataclass
class RolloutForwards:
    """No-grad forwards over a rollout (all (B, R), 0-padded past each response's end)."""

    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor
    entropy: Tensor


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, with EOS standing in for a missing pad token."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_stop_token(tokenizer: PreTrainedTokenizerBase, stop_token: str | None) -> int:
    """The id of ``generation.stop_token`` (EOS when unset), checked against the vocabulary."""
    if stop_token is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("generation.stop_token is unset and the tokenizer has no EOS token: set one")
        return tokenizer.eos_token_id
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    if token_id is None or token_id == tokenizer.unk_token_id and stop_token != tokenizer.unk_token:
        raise ValueError(
            f"generation.stop_token {stop_token!r} is not a single token of the tokenizer's vocabulary"
        )
    return token_id


class PPOLightningModule(LightningModule):
    """PPO for RLHF of a Hugging Face causal LM.

    Override :meth:`score` in a subclass for a custom reward, or pass ``reward_fn`` / ``reward_model``.

    Args:
        policy: Path or hub name of the causal LM to train.
        reward_model: Path of an ``AutoModelForSequenceClassification`` (num_labels=1) sharing the
            policy's tokenizer; the score is read at the last real token.
        reward_fn: A ``RewardFunction`` on text, selected by ``class_path``.
        value_model: Checkpoint the critic's backbone is loaded from (default: the policy).
        reference: Checkpoint of the frozen reference policy (default: the initial policy).
        tokenizer: Tokenizer path (default: the policy's).
        ppo: PPO hyper-parameters.
        generation: Sampling settings for rollouts.
        optimizer: Optimizer over the policy and the critic (one optimizer for both).
        lr_scheduler: Optional scheduler, stepped after every optimizer step.
        seed: Seed of the minibatch shuffling (the Trainer's ``seed_everything`` seeds sampling).
        trust_remote_code: Allow checkpoints to run their own code. Off unless you trust them.
    """

    def __init__(
        self,
        policy: str,
        reward_model: str | None = None,
        reward_fn: RewardFunction | None = None,
        value_model: str | None = None,
        reference: str | None = None,
        tokenizer: str | None = None,
        ppo: PPOConfig = PPOConfig(),
        generation: GenerationConfig = GenerationConfig(),
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        # Frozen roles are left out of checkpoints, so loading one must not demand their keys.
        self.strict_loading = False
        has_custom_score = type(self).score is not PPOLightningModule.score
        if reward_fn is None and reward_model is None and not has_custom_score:
            raise ValueError("no reward: set reward_fn or reward_model, or override score() in a subclass")
        if reward_fn is not None and reward_model is not None:
            raise ValueError("set only one of reward_fn and reward_model")
        self.save_hyperparameters(
            {
                "policy": policy,
                "reward_model": reward_model,
                "value_model": value_model,
                "reference": reference,
                "ppo": asdict(ppo),
                "generation": asdict(generation),
                "seed": seed,
            }
        )
        self.ppo, self.generation_config, self.seed = ppo, generation, seed
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.tokenizer = load_tokenizer(tokenizer or policy, trust_remote_code)
        self.stop_token_id = resolve_stop_token(self.tokenizer, generation.stop_token)
        self.hf_generation = hf_generation_config(generation, self.stop_token_id, self.tokenizer.pad_token_id)
        self.policy = load_causal_lm(policy, trust_remote_code)
        self.ref_policy = freeze(load_causal_lm(reference or policy, trust_remote_code))
        self.value_model = ValueModel.from_pretrained(value_model or policy, trust_remote_code)
        self.reward_fn = reward_fn
        self.reward_model = (
            RewardModel.from_pretrained(reward_model, trust_remote_code) if reward_model else None
        )
        self.kl_ctl = make_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.iteration = 0
        self.episodes = 0

    # ----------------------------------------------------------------- the PPO iteration
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self.ppo.check_batch_size(len(batch))
        rollout = self.generate(batch)
        prompts, completions = batch.prompts, self.decode_responses(rollout)
        scores = self.score(prompts, completions, ScoreInputs(batch.extras, rollout))
        scores = check_scores(scores, len(batch), self.reward_name, self.device)
        forwards = self.rollout_forwards(rollout)
        exp = make_experience(
            rollout,
            forwards.logprobs,
            forwards.ref_logprobs,
            forwards.values,
            scores,
            self.kl_ctl.value,
            self.ppo,
        )
        stats = self.ppo_update(exp)
        mean_kl = exp.kl.sum(dim=1).mean()
        self.iteration += 1
        self.episodes += len(batch) * self.trainer.world_size
        stats.update(self.experience_stats(exp, forwards.entropy, rollout.ended))
        stats["kl_coef"] = torch.tensor(self.kl_ctl.value)
        self.kl_ctl.update(float(mean_kl), len(batch) * self.trainer.world_size)
        self.log_stats(stats, len(batch))

    def generate(self, batch: PromptBatch) -> Rollout:
        """Sample one response per prompt with the current policy."""
        return generate(self.policy, batch.prompt_ids, batch.prompt_mask, self.hf_generation)

    def decode_responses(self, rollout: Rollout) -> list[str]:
        """Response text without the stop token or padding."""
        lengths = rollout.response_lengths.tolist()
        ids = [row[:n] for row, n in zip(rollout.response_ids.tolist(), lengths, strict=True)]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def score(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor | list[float]:
        """One score per completion. Override in a subclass for a custom reward.

        Args:
            prompts: Prompt text as given to the policy (after the chat template).
            completions: Sampled response text, without the stop token.
            batch: The dataset's extra columns (``batch.extras``) and the token ids (``batch.rollout``).
        """
        if self.reward_fn is not None:
            return self.reward_fn(prompts, completions, batch)
        rollout = batch.rollout
        return self.reward_model(rollout.input_ids, rollout.attention_mask, rollout.position_ids)

    @property
    def reward_name(self) -> str:
        if self.reward_fn is not None:
            return self.reward_fn.name
        return "reward_model" if self.reward_model is not None else f"{type(self).__name__}.score"

    @torch.no_grad()
    def rollout_forwards(self, rollout: Rollout) -> RolloutForwards:
        """Log-probs, reference log-probs, values and entropy of the sampled responses."""
        chunk = self.generation_config.forward_chunk_size or len(rollout.input_ids)
        ids, mask, pos = rollout.input_ids, rollout.attention_mask, rollout.position_ids
        parts = []
        for i in range(0, len(ids), chunk):
            sl = slice(i, i + chunk)
            tokens = rollout.response_ids[sl]
            length = tokens.shape[1]
            logits = response_logits(self.policy, ids[sl], mask[sl], pos[sl], length)
            ref_logits = response_logits(self.ref_policy, ids[sl], mask[sl], pos[sl], length)
            temperature = self.generation_config.temperature
            parts.append(
                (
                    F.logprobs_from_logits(logits, tokens, temperature),
                    F.logprobs_from_logits(ref_logits, tokens, temperature),
                    self.response_values(ids[sl], mask[sl], pos[sl], length),
                    F.entropy_from_logits(logits, temperature),
                )
            )
        logprobs, ref_logprobs, values, entropy = (torch.cat(p) for p in zip(*parts, strict=True))
        zero = ~rollout.response_mask
        return RolloutForwards(
            logprobs.masked_fill(zero, 0.0),
            ref_logprobs.masked_fill(zero, 0.0),
            values.masked_fill(zero, 0.0),
            entropy.masked_fill(zero, 0.0),
        )

    def response_values(self, ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
        """(B, R) critic value of the state before each of the last ``length`` tokens."""
        return self.value_model(ids, mask, pos)[:, -length - 1 : -1]

    # ----------------------------------------------------------------- the inner PPO epochs
    def ppo_update(self, exp: Experience) -> dict[str, Tensor]:
        """``ppo_epochs`` passes of shuffled minibatches; one optimizer step per minibatch."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        generator = torch.Generator().manual_seed(self.seed + self.iteration)
        accumulate = self.ppo.gradient_accumulation_steps
        history: list[dict[str, Tensor]] = []
        for _ in range(self.ppo.ppo_epochs):
            for minibatch in exp.minibatches(self.ppo.num_minibatches, generator):
                for i, micro in enumerate(minibatch.split(accumulate)):
                    # Under DDP only the last micro-batch of a minibatch all-reduces gradients.
                    sync = i == accumulate - 1
                    with nullcontext() if sync else self._no_backward_sync():
                        loss, stats = self.ppo_loss(micro)
                        self.manual_backward(loss / accumulate)
                    history.append(stats)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
        return {key: torch.stack([h[key] for h in history]).mean() for key in history[0]}

    def ppo_loss(self, mb: Experience) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss + vf_coef x clipped value loss - entropy_coef x entropy, on one micro-batch."""
        length = mb.response_ids.shape[1]
        logits = response_logits(self.policy, mb.input_ids, mb.attention_mask, mb.position_ids, length)
        temperature = self.generation_config.temperature
        logprobs = F.logprobs_from_logits(logits, mb.response_ids, temperature)
        pg = F.policy_loss(logprobs, mb.logprobs, mb.advantages, mb.response_mask, self.ppo.clip_range)
        values = self.response_values(mb.input_ids, mb.attention_mask, mb.position_ids, length)
        vf = F.value_loss(values, mb.values, mb.returns, mb.response_mask, self.ppo.value_clip_range)
        with torch.set_grad_enabled(self.ppo.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = F.masked_mean(F.entropy_from_logits(logits, temperature), mb.response_mask)
        loss = pg.loss + self.ppo.vf_coef * vf.loss - self.ppo.entropy_coef * entropy
        stats = {
            "policy/approxkl_avg": pg.approx_kl,
            "policy/clipfrac_avg": pg.clipfrac,
            "policy/entropy_avg": entropy.detach(),
            "loss/policy_avg": pg.loss.detach(),
            "loss/value_avg": vf.loss.detach(),
            "val/clipfrac_avg": vf.clipfrac,
            "val/ratio": pg.ratio,
        }
        return loss, stats

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called by the precision plugin after gradients are unscaled (16-mixed), so the norm is real.
        if self.ppo.max_grad_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.ppo.max_grad_norm)

    def _no_backward_sync(self) -> Any:
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if block is not None else nullcontext()

    # ----------------------------------------------------------------- logging
    def experience_stats(self, exp: Experience, entropy: Tensor, ended: Tensor) -> dict[str, Tensor]:
        """Per-iteration statistics of the rollout; token statistics count real tokens only."""
        mask = exp.response_mask
        non_score = (-self.kl_ctl.value * exp.kl).sum(dim=1)
        return {
            "objective/kl": exp.kl.sum(dim=1).mean(),
            "objective/entropy": entropy.sum(dim=1).mean(),
            "objective/non_score_reward": non_score.mean(),
            "objective/rlhf_reward": (exp.scores + non_score).mean(),
            "objective/scores": exp.scores.mean(),
            "val/explained_variance": F.explained_variance(exp.values, exp.returns, mask),
            "returns/mean": F.masked_mean(exp.returns, mask),
            "returns/std": F.masked_var(exp.returns, mask).sqrt(),
            "advantages/mean": F.masked_mean(exp.advantages, mask),
            "response/length_mean": mask.sum(dim=1).float().mean(),
            "response/eos_fraction": ended.float().mean(),
        }

    def log_stats(self, stats: dict[str, Tensor], batch_size: int) -> None:
        stats["lr"] = torch.tensor(self.optimizers().param_groups[0]["lr"])
        stats["episode"] = torch.tensor(float(self.episodes))
        stats["iteration"] = torch.tensor(float(self.iteration))
        progress = {"objective/scores", "objective/kl"}
        shown = {k: v for k, v in stats.items() if k in progress}
        rest = {k: v for k, v in stats.items() if k not in progress}
        self.log_dict(
            shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True
        )
        self.log_dict(rest, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True)

    # ----------------------------------------------------------------- optimizers, checkpoints
    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Frozen roles are rebuilt from their checkpoints at load time: saving them wastes disk.
        frozen = ("ref_policy.", "reward_model.")
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(frozen)
        }
        checkpoint["ppo_state"] = {
            "kl_coef": float(self.kl_ctl.value),
            "iteration": self.iteration,
            "episodes": self.episodes,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("ppo_state", {})
        self.kl_ctl.value = state.get("kl_coef", self.kl_ctl.value)
        self.iteration = state.get("iteration", 0)
        self.episodes = state.get("episodes", 0)
