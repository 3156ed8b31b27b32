"""Generation engines: what samples the rollout batch from the current policy.

``hf`` (the default) is Hugging Face ``generate`` on the trained policy itself. ``vllm`` is an
in-process vLLM engine colocated with training, whose weights are pushed from the policy once per
iteration. ``vllm_server`` samples on running vLLM servers (``server``), synced and checked every
iteration (the ``server/`` folder: :mod:`.server`). All return the same
:class:`~lightning_ppo.ppo.rollout_data.Rollout`, so nothing downstream
knows which one sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import transformers
from torch import Tensor, nn

from lightning_ppo.config import GenerationConfig
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.rollout_data import Rollout

ENGINES = ("hf", "vllm", "vllm_server")


@dataclass(frozen=True)
class Placement:
    """Where this process sits among the training ranks (a colocated engine joins them)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0


@dataclass(frozen=True)
class ServerSide:
    """What the server engine checks servers against, and how rank 0's sync verdict reaches the others."""

    tokenizer: Any
    vocab_size: int
    from_rank_zero: Callable[[Any], Any]


class GenerationEngine(Protocol):
    """Samples one response per left-padded prompt from the weights last synced."""

    def sync_weights(self, policy: nn.Module) -> None:
        """Make the next :meth:`generate` sample from ``policy``'s current weights."""

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        """Responses masked at the first stop token; ``engine_logprobs`` set where the engine has them."""


def compute_dtype(precision: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainer computes in under the Trainer's ``precision``: bf16 or fp16 under
    mixed (autocast, FSDP2's ``param_dtype``) or true half precision, else the parameters'.

    A colocated engine samples in it, so that ``bf16-mixed`` does not hold an fp32 copy of the
    policy (twice the memory planned for) and samples from what the trainer computes.
    """
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return param_dtype


def make_engine(
    config: GenerationConfig,
    hf_generation: transformers.GenerationConfig,
    policy_path: str,
    placement: Placement,
    seed: int,
    dtype: torch.dtype = torch.float32,
    servers: ServerSide | None = None,
) -> GenerationEngine:
    """The engine ``config.engine`` names, sampling as ``hf_generation`` says. vLLM (which loads
    ``policy_path`` in ``dtype``) is imported only when asked for; the server engine needs
    ``servers``."""
    if config.engine == "vllm_server":
        from lightning_ppo.rollout.engines.server import VLLMServerEngine

        if servers is None:
            raise ValueError("generation.engine 'vllm_server' needs the tokenizer and vocabulary (servers)")
        return VLLMServerEngine(
            config, hf_generation, placement, servers.tokenizer, servers.vocab_size, servers.from_rank_zero
        )
    if config.engine == "vllm":
        from lightning_ppo.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(config, hf_generation, policy_path, placement, seed, dtype)
    from lightning_ppo.rollout.engines.hf import HFEngine

    return HFEngine(hf_generation, config.cache_implementation)


def engine_for_trainer(
    trainer: Any,
    config: GenerationConfig,
    hf_generation: transformers.GenerationConfig,
    policy_path: str,
    seed: int,
    policy: nn.Module,
    tokenizer: Any = None,
) -> GenerationEngine:
    """:func:`make_engine` placed among ``trainer``'s ranks (one process without a trainer), seeded
    per rank, sampling in the dtype the trainer computes in."""
    placement = (
        Placement(trainer.world_size, trainer.global_rank, trainer.local_rank)
        if trainer is not None
        else Placement()
    )
    precision = str(trainer.precision) if trainer is not None else "32-true"
    dtype = compute_dtype(precision, policy.dtype)
    several = trainer is not None and trainer.world_size > 1
    servers = ServerSide(
        tokenizer,
        int(policy.config.vocab_size),
        (lambda value: trainer.strategy.broadcast(value, src=0)) if several else (lambda value: value),
    )
    return make_engine(config, hf_generation, policy_path, placement, seed + placement.rank, dtype, servers)


def engine_is_weights(
    config: GenerationConfig, rollout: Rollout, logprobs: Tensor, max_staleness: int = 0
) -> Tensor | None:
    """Truncated behaviour-vs-trainer importance weights of the policy loss, if configured
    (``generation.engine_is_correction``) or sampled ahead (``ppo.max_staleness`` > 0: the decoupled
    loss, ``token`` level unless configured), and the engine gave its log-probs."""
    level = config.engine_is_correction or ("token" if max_staleness > 0 else None)
    if level is None or rollout.engine_logprobs is None:
        return None
    cap = config.engine_is_cap
    return F.truncated_is_weights(logprobs, rollout.engine_logprobs, rollout.response_mask, level, cap)


def engine_metrics(
    logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, level: F.ISLevel, cap: float
) -> dict[str, Tensor]:
    """How far the sampling engine's log-probs are from the trainer's on the sampled tokens.

    ``engine/logp_abs_diff`` is the mean |logp_engine - logp_trainer| over real tokens;
    ``engine/is_truncated_fraction`` the fraction of real tokens whose importance weight (at
    ``level``, ``token`` when no correction is applied) would be truncated at ``cap``;
    ``engine/is_weight_std`` the spread of those weights before truncation (0: the engine sampled
    from the trainer's distribution).
    """
    weights = F.engine_log_ratio(logprobs, engine_logprobs, mask, level).exp()
    return {
        "engine/logp_abs_diff": F.masked_mean((logprobs - engine_logprobs).abs(), mask),
        "engine/is_truncated_fraction": F.masked_mean((weights > cap).float(), mask),
        "engine/is_weight_std": F.masked_var(weights, mask, unbiased=False).sqrt(),
    }


def engine_mismatch(config: GenerationConfig, rollout: Rollout, logprobs: Tensor) -> dict[str, Tensor]:
    """``engine/*`` metrics when an engine other than the trainer sampled, else none."""
    if rollout.engine_logprobs is None:
        return {}
    level = config.engine_is_correction or "token"
    return engine_metrics(
        logprobs, rollout.engine_logprobs, rollout.response_mask, level, config.engine_is_cap
    )
