"""A colocated, in-process vLLM engine per rank, its weights pushed from the policy every iteration.

The pattern is TRL's colocate mode: each training process owns one engine (under several ranks
vLLM's ``external_launcher`` backend, so vLLM joins the ranks torch.distributed already runs),
generation reads prompts as token ids, and before each rollout the trained weights are loaded
into the engine's model in place (LoRA as base + delta computed out of place; FSDP2 shards
gathered with ``full_tensor()``). The engine's own log-probs come back with the rollout; PPO still recomputes
old log-probs with the trainer, and the two are compared every iteration.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import transformers
from torch import Tensor, nn

from lightning_ppo.config import GenerationConfig
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.completions import completions_to_rollout, row_seeds
from lightning_ppo.rollout.engines.weights import hf_weights
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.preflight import VLLM_INSTALL_HINT as INSTALL_HINT
from lightning_ppo.runs.quiet import quiet_vllm


@contextmanager
def untouched_global_rng() -> Iterator[None]:
    """Run vLLM without it changing the process's random state.

    vLLM 0.32 seeds Python's ``random``, NumPy and torch (``set_random_seed``) when its worker
    starts, which happens lazily, inside a later call: the per-rank offset of ``seed_everything``
    and the RNG states a resumed run restored would be overwritten, and a resumed run would draw
    iteration 0's seeds again. Every call into vLLM runs inside this fork of all three generators
    (and CUDA's). Sampling does not need them: each request carries its own seed.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def import_vllm() -> Any:
    """vLLM, in-process: its V1 engine otherwise runs the model in a child process, where the
    policy's weights could not be loaded by reference."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet_vllm()
    try:
        import vllm
    except ImportError as err:
        raise UsageError(f"generation.engine 'vllm' needs the vllm package ({err}): {INSTALL_HINT}") from err
    return vllm


class VLLMEngine:
    """Samples with vLLM under exactly the settings of ``hf_generation`` (no checkpoint defaults)."""

    def __init__(
        self,
        config: GenerationConfig,
        hf_generation: transformers.GenerationConfig,
        policy_path: str,
        placement: Placement,
        seed: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        vllm = import_vllm()
        self.vllm = vllm
        self.stop_token_id = hf_generation.eos_token_id
        self.pad_token_id = hf_generation.pad_token_id
        self.max_new_tokens = hf_generation.max_new_tokens
        self.on_gpu = torch.cuda.is_available()
        kwargs: dict[str, Any] = {}
        if placement.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # The external launcher reads torchrun's variables; Lightning's launcher sets no RANK.
            os.environ.setdefault("RANK", str(placement.rank))
            os.environ.setdefault("LOCAL_RANK", str(placement.local_rank))
        with untouched_global_rng():
            self.llm = self._build(vllm, policy_path, dtype, config, seed, kwargs)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        # A stop token past the model's output vocabulary can never be sampled, and vLLM rejects it
        # as a stop id ("out-of-vocab token ids"): only stop ids the model can emit are passed.
        self.stop_token_ids = [t for t in [self.stop_token_id] if t is not None and 0 <= t < self.vocab_size]
        self.hf_generation = hf_generation
        self.asleep = False

    def _build(
        self, vllm: Any, path: str, dtype: torch.dtype, config: GenerationConfig, seed: int, kwargs: dict
    ) -> Any:
        return vllm.LLM(
            model=path,
            dtype=str(dtype).removeprefix("torch."),
            enforce_eager=True,
            gpu_memory_utilization=config.gpu_memory_utilization,
            seed=seed,
            # Prompts and responses stay token ids; no tokenizer is loaded, so none can differ.
            skip_tokenizer_init=True,
            # vLLM's defaults, not the checkpoint's generation_config.json: every setting is ours.
            generation_config="vllm",
            # Log-probs of the distribution sampled from (temperature, suppressed tokens applied).
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.on_gpu,
            **kwargs,
        )

    def allowed_token_ids(self) -> list[int] | None:
        """Every id but ``suppress_tokens`` (vLLM masks the others to -inf), or None for all."""
        suppressed = set(self.hf_generation.suppress_tokens or ())
        return [i for i in range(self.vocab_size) if i not in suppressed] if suppressed else None

    def sampling_params(self, seed: int, allowed: list[int] | None) -> Any:
        """One request's settings; ``seed`` makes its draw reproducible."""
        gen = self.hf_generation
        sampled = bool(gen.do_sample)
        return self.vllm.SamplingParams(
            n=1,
            temperature=gen.temperature if sampled else 0.0,
            top_k=(gen.top_k or -1) if sampled else -1,
            top_p=gen.top_p if sampled else 1.0,
            max_tokens=self.max_new_tokens,
            # Only our stop token ends a response, as in HF generate with eos_token_id=stop.
            stop_token_ids=self.stop_token_ids,
            ignore_eos=True,
            allowed_token_ids=allowed,
            logprobs=0,
            seed=seed,
            detokenize=False,
        )

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Load the policy's current weights into the engine's model, in place.

        On GPUs the engine slept at level 2 since the last rollout (weights and KV cache freed, not
        copied to the host: the weights are overwritten here anyway); its weights' memory wakes
        first, the KV cache only after the push, so the two never peak together (as TRL does).
        Untested on CPU, where there is no sleep mode.
        """
        with untouched_global_rng():
            if self.asleep:
                self.llm.wake_up(tags=["weights"])
            # vLLM's in-place reload (0.32): plain ``model.load_weights`` fails on layers whose
            # weights the CPU backend repacked after the first load; the reload redoes that processing.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_weights(policy)})
            self.llm.apply_model(repack_embedding_gemms)
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
                self.asleep = False
            # Cached KV blocks were computed with the old weights.
            self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        rows = [row[mask].tolist() for row, mask in zip(prompt_ids, prompt_mask.bool(), strict=True)]
        prompts = [self.vllm.TokensPrompt(prompt_token_ids=row) for row in rows]
        seeds = row_seeds(rows)  # per request, as the server engine's grouped requests seed them
        allowed = self.allowed_token_ids()
        params = [self.sampling_params(seed, allowed) for seed in seeds]
        with untouched_global_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            if self.on_gpu:
                self.llm.sleep(level=2)  # frees weights and KV cache for the PPO epochs
                self.asleep = True
        return self.to_rollout(prompt_ids, prompt_mask, [o.outputs[0] for o in outputs])

    def to_rollout(self, prompt_ids: Tensor, prompt_mask: Tensor, completions: list[Any]) -> Rollout:
        tokens = [list(c.token_ids) for c in completions]
        logprobs = [
            [step[token].logprob for step, token in zip(c.logprobs, row, strict=True)]
            for c, row in zip(completions, tokens, strict=True)
        ]
        return completions_to_rollout(
            prompt_ids, prompt_mask, tokens, logprobs, self.stop_token_id, self.pad_token_id
        )


def repack_embedding_gemms(model: nn.Module) -> None:
    """Redo the CPU backend's packing of the (tied) LM head from its reloaded weight.

    vLLM 0.32's in-place reload processes a tied weight for one of its layers only: on CPU the
    LM head kept the GEMM it packed from the first weights (measured: logits 1.2 off after one
    sync, 0 after this). On GPUs this processing is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
