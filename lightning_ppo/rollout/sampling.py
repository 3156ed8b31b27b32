"""Sampling responses from the policy with Hugging Face ``generate``, and the masks that say which
response tokens are real. What it returns is a :class:`~lightning_ppo.ppo.rollout_data.Rollout`."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lightning_ppo.config import GenerationConfig
from lightning_ppo.models.loading import resolve_stop_token, resolve_suppressed_tokens
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout import compiled_decoding
from lightning_ppo.rollout.static_cache import OneDtypeStaticCache, cache_argument
from lightning_ppo.runs.quiet import quiet_generation


def truncate_at_stop(
    response_ids: Tensor, stop_token_id: int, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Mask everything after the first stop token.

    Returns:
        ``(response_ids, response_mask, ended)``: ids with pad after the stop token, the positive
        mask (stop token included) and whether each row emitted the stop token.
    """
    is_stop = response_ids == stop_token_id
    ended = is_stop.any(dim=1)
    last = response_ids.shape[1] - 1
    stop_at = torch.where(ended, is_stop.int().argmax(dim=1), torch.full_like(ended, last, dtype=torch.long))
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = positions[None, :] <= stop_at[:, None]
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_token_id))
    return response_ids, response_mask, ended


def hf_generation_config(
    config: GenerationConfig,
    stop_token_id: int,
    pad_token_id: int,
    do_sample: bool = True,
    suppressed: list[int] | None = None,
) -> transformers.GenerationConfig:
    """An explicit HF generation config, so that no default from the checkpoint (top_k=50,
    repetition penalty, ...) changes the distribution the log-probs are computed under.
    ``do_sample=False`` gives greedy decoding (validation). ``suppressed`` ids are never generated
    (their logits are set to -inf; the trainer's log-probs mask the same ids). ``generate`` never
    compiles itself (on a GPU it would for a static cache, again for every new batch shape); with
    ``generation.compile`` the config carries a ``compile_config`` and :func:`generate` decodes
    through ``rollout/compiled_decoding.py``, which bounds the shapes."""
    shared = dict(
        max_new_tokens=config.max_new_tokens,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
        suppress_tokens=list(suppressed) if suppressed else None,
        use_cache=True,
        disable_compile=True,
    )
    if config.compile:
        shared.update(disable_compile=False, compile_config=compiled_decoding.compile_config())
    if not do_sample:
        return transformers.GenerationConfig(do_sample=False, **shared)
    return transformers.GenerationConfig(
        do_sample=True, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, **shared
    )


@dataclass
class SamplingSetup:
    """How a run samples, from ``generation`` and the policy's tokenizer (the module keeps each field)."""

    stop_token_id: int
    suppressed_ids: list[int]  # never sampled; the log-probs mask the same ids
    hf_generation: transformers.GenerationConfig  # rollouts
    hf_eval_generation: transformers.GenerationConfig  # validation: greedy unless generation.eval_do_sample

    @classmethod
    def of(cls, generation: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> SamplingSetup:
        stop_token_id = resolve_stop_token(tokenizer, generation.stop_token)
        suppressed = resolve_suppressed_tokens(tokenizer, generation.suppress_tokens, generation.stop_token)
        pad_id = tokenizer.pad_token_id
        return cls(
            stop_token_id,
            suppressed,
            hf_generation_config(generation, stop_token_id, pad_id, suppressed=suppressed),
            hf_generation_config(generation, stop_token_id, pad_id, generation.eval_do_sample, suppressed),
        )


@contextmanager
def weights_cast_once(device_type: str) -> Iterator[None]:
    """Under mixed precision, cast each weight to the low dtype once for a whole generation.

    Lightning's autocast keeps no cast cache, because weights change between optimizer steps
    inside one ``training_step``; without one, every decoding step casts every weight again
    (measured: 3 % of a small model's generation on CPU). The weights are fixed while
    generating, so a cache is safe there; it is dropped right after, before any update.
    """
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    dtype = torch.get_autocast_dtype(device_type)
    try:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=True):
            yield
    finally:
        torch.clear_autocast_cache()


@contextmanager
def compiling_waits_for_sampling(generation_config: transformers.GenerationConfig) -> Iterator[None]:
    """A sampling ``generate`` holds dynamo's compilation lock throughout: no compilation on another
    thread overlaps its draws, and it waits for one under way.

    Dynamo puts torch's global random state back as it found it when a compilation began
    (``preserve_global_state``, ``torch._dynamo.convert_frame``), so what another thread drew from
    the global generator meanwhile was drawn again after it. With ``ppo.max_staleness`` the
    background thread samples while the main thread may compile (``generation.compile``'s
    validation shapes, ``ppo.torch_compile``'s loss): the rollouts reused random numbers (a test saw
    each row's first token sampled twice). The lock is re-entrant: a compilation this ``generate``
    starts itself (compiled decoding) takes it again. The price: a compilation waits for a sampling
    ``generate`` on another thread, and the reverse; greedy decoding draws nothing and holds nothing.
    """
    from torch._dynamo import convert_frame

    lock = getattr(convert_frame, "compile_lock", None) if generation_config.do_sample else None
    with lock or nullcontext():
        yield


def cache_for(
    model: transformers.PreTrainedModel,
    prompt_width: int,
    generation_config: transformers.GenerationConfig,
    kind: str,
) -> dict[str, transformers.Cache]:
    """``generate``'s ``cache`` argument: a static cache of exactly this call's length, or none
    (HF's dynamic cache, which ``generate`` makes itself).

    Not ``cache_implementation="static"``: HF then sizes every later cache of the same model to the
    longest it ever made, so one long batch (or a validation pass) would make every shorter
    generation after it attend over that whole length (measured: 2.2x the dynamic cache's time).
    Each step attends over the tokens written so far, not the whole length (``trim``, while
    :data:`TRIM_STATIC`).
    """
    supported = getattr(model, "_supports_default_dynamic_cache", None)
    argument = cache_argument(model)
    if kind == "dynamic" or supported is None or not supported() or argument is None:
        return {}
    length = prompt_width + generation_config.max_new_tokens
    return {argument: OneDtypeStaticCache(config=model.config, max_cache_len=length, trim=TRIM_STATIC)}


# Eager decoding on the static cache attends over the tokens written so far (``OneDtypeStaticCache``'s
# ``trim``); ``benchmarks/decoding.py --modes static-full`` turns it off to compare.
TRIM_STATIC = True


@torch.no_grad()
def generate(
    model: transformers.PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    generation_config: transformers.GenerationConfig,
    cache: str | transformers.Cache = "static",
) -> Rollout:
    """Sample one response per left-padded prompt and mask it at the first stop token. ``cache``:
    ``static`` or ``dynamic`` (``GenerationConfig.cache_implementation``), or a cache to continue
    (``rollout/kept_cache.py``: its tokens are the prompt's first ones, ``generate`` reads the rest
    and grows it in place). A config with ``generation.compile`` on decodes through
    ``rollout/compiled_decoding.py`` (its own kept static caches); a cache to continue, or a model
    without a static cache, decodes eagerly."""
    compiled = isinstance(cache, str) and compiled_decoding.wanted(generation_config)
    compiled = compiled and compiled_decoding.can_decode(model)
    was_training = model.training
    # Generation runs in eval mode: with gradient checkpointing in train mode HF drops the KV cache.
    model.eval()
    apart = compiling_waits_for_sampling(generation_config)
    try:  # a failed or interrupted generate (a caught OOM, a retry) leaves the mode as it found it
        with apart, weights_cast_once(prompt_ids.device.type), quiet_generation():
            new_tokens = None
            if compiled:
                new_tokens = compiled_decoding.decode(model, prompt_ids, prompt_mask, generation_config)
            if new_tokens is None:
                new_tokens = _eager(model, prompt_ids, prompt_mask, generation_config, cache)
    finally:
        model.train(was_training)
    response_ids, response_mask, ended = truncate_at_stop(
        new_tokens, generation_config.eos_token_id, generation_config.pad_token_id
    )
    return Rollout(prompt_ids, prompt_mask.bool(), response_ids, response_mask, ended)


def _eager(
    model: transformers.PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    generation_config: transformers.GenerationConfig,
    cache: str | transformers.Cache,
) -> Tensor:
    """:func:`generate`'s new tokens, decoded eagerly (``generate`` never compiles itself)."""
    if compiled_decoding.wanted(generation_config):
        generation_config = copy.copy(generation_config)
        generation_config.disable_compile = True
    if isinstance(cache, str):
        given_cache = cache_for(model, prompt_ids.shape[1], generation_config, cache)
    else:
        given_cache = {cache_argument(model) or "past_key_values": cache}
    sequences = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        generation_config=generation_config,
        **given_cache,
    )
    return sequences[:, prompt_ids.shape[1] :]
