"""``generation.compile``: the decoding steps of HF ``generate`` through ``torch.compile``, a bounded
number of times per run.

transformers compiles the model's forward itself when ``generate`` gets a static cache and a
``compile_config``: the prefill runs eagerly, every decoding step calls the compiled forward (CUDA
graphs on a GPU with ``mode="reduce-overhead"``, its default), and each step's attention mask is
built outside the graph at the cache's full length. What it leaves to the caller is done here:

- **Bounded shapes.** A decoding step's graph depends on the batch size and the cache length alone,
  not on the prompt's width (the prompt is read by the eager prefill; measured: prompts of 5, 9 and
  12 tokens into one cache length, one compilation, and model copies of one architecture share it).
  So the batch is padded to the next power of two (the extra rows copy the first prompt and emit
  the stop token at once: :class:`FinishRows`; a function of the rows alone, so that what a batch
  samples never depends on the batches decoded before it, as after a resume or in a snapshot,
  since the extra rows draw from the generator too), and the cache length is
  ``max_new_tokens`` plus the prompt width rounded up to a power of two (at least
  :data:`MIN_PROMPT_BUCKET`), or a sliding window's length where the generation fits in it
  (:func:`cache_length`). A run of fixed-width prompts compiles once; prompts of 8-256 tokens
  at most five times per batch size.
- **One cache per shape, kept.** Each (batch, length, dtype) gets one static cache, reset and reused
  by every later call instead of allocated per call (CUDA graphs replay on fixed addresses). They
  stay allocated between iterations: the memory of one generation's cache per shape, held through
  the update too; those of a device or weight dtype the model has left are dropped at its next call.
- **The compiled call belongs to this module.** It is handed to ``generate`` for the call only
  (``get_compiled_call`` on the instance, removed after), so a copy of the policy
  (``ppo.max_staleness`` snapshots are ``copy.deepcopy``) never carries a call bound to the original.
  The state kept on the model (:class:`DecodingState`) copies as a new, empty one.
- **Counted.** Every graph compiled for decoding passes through one backend (:data:`COMPILATIONS`),
  which counts them and the seconds they took.

Not compiled: the prefill (a new width each batch), the sampling (softmax and ``torch.multinomial``,
as eager ``generate`` runs them), a cache kept across an episode's turns (``episode.keep_cache``: a
``DynamicCache`` whose rows drop as episodes end), models without a static cache, and FSDP2
(refused in one line: the gathered weights are new tensors at every ``generate``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers.cache_utils import StaticLayer

from lightning_ppo.rollout.static_cache import OneDtypeStaticCache, cache_argument
from lightning_ppo.runs.errors import UsageError

MIN_PROMPT_BUCKET = 16  # the smallest prompt width a cache is sized for
# The backend of the decoding graphs; ``None``: inductor, with CUDA graphs on a GPU. The tests set
# "aot_eager" (the same graphs and guards, so the same count, without inductor's code generation).
BACKEND: str | None = None
# Inductor keeps a fused kernel's intermediates in fp32 where eager rounds each op's result to
# bf16/fp16: under bf16-mixed a tiny Llama's log-probs then moved by 2e-3 and one greedy token
# changed (CPU). Emulating the casts rounds where eager rounds, not bit for bit as eager does (the
# kernels still sum in their own order): measured on the four families (12 steps, CPU), eager's
# tokens, and log-probs within 4.8e-4 of eager's (0.17 of one bf16 step of the largest logit),
# within 1.6e-5 of an untrimmed eager cache's under AVX2 kernels and equal to it under AVX-512 or
# scalar ones; tests/tolerances.py derives what may differ.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def prompt_bucket(width: int) -> int:
    """The prompt width a cache is sized for: ``width`` rounded up to a power of two, at least
    :data:`MIN_PROMPT_BUCKET`."""
    bucket = MIN_PROMPT_BUCKET
    while bucket < width:
        bucket *= 2
    return bucket


def compile_config() -> transformers.CompileConfig:
    """What ``hf_generation_config`` puts in the HF generation config when ``generation.compile`` is
    on: it marks the config as compiling (also on a CPU, where transformers would not) and carries
    the settings. :func:`decode` compiles with them; ``generate`` never compiles by itself."""
    config = transformers.CompileConfig(fullgraph=False, dynamic=False)
    config._compile_all_devices = True  # transformers' flag for devices other than GPUs
    return config


def wanted(generation_config: transformers.GenerationConfig) -> bool:
    """Whether ``generation_config`` asks for compiled decoding (``generation.compile``)."""
    return not generation_config.disable_compile and generation_config.compile_config is not None


@dataclass
class Compilations:
    """The graphs compiled for decoding in this process and the seconds their compilation took
    (the backend's; dynamo's tracing before it is in a call's time, not here)."""

    count: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.count += 1
            self.seconds += seconds


COMPILATIONS = Compilations()


class _CountingBackend:
    """``torch.compile``'s backend for decoding: ``name`` (``None``: inductor, ``mode`` its
    options), counting each graph into :data:`COMPILATIONS`."""

    def __init__(self, name: str | None, mode: str | None) -> None:
        self.name, self.mode = name, mode
        if name is None or name == "inductor":
            from torch._inductor import config

            options = {k: v for k, v in INDUCTOR_OPTIONS.items() if hasattr(config, k)}
            self.inner: Callable = torch._TorchCompileInductorWrapper(mode, options, False)
        else:
            self.inner = torch._dynamo.lookup_backend(name)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        start = time.perf_counter()
        try:
            return self.inner(graph, example_inputs)
        finally:
            COMPILATIONS.add(time.perf_counter() - start)


_BACKENDS: dict[tuple[str | None, str | None], _CountingBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def _backend(device: torch.device) -> _CountingBackend:
    """One backend object per (backend, mode) in the process: dynamo reuses a graph only under the
    backend that compiled it."""
    mode = "reduce-overhead" if device.type == "cuda" and BACKEND in (None, "inductor") else None
    key = (BACKEND, mode)
    with _BACKENDS_LOCK:  # a background thread (ppo.max_staleness) may ask at the same time
        if key not in _BACKENDS:
            _BACKENDS[key] = _CountingBackend(*key)
        return _BACKENDS[key]


class WindowLayer(StaticLayer):
    """A sliding-window (or chunked) layer's cache for a generation that never fills its window: a
    plain static layer, which attends exactly as the window does while nothing has left it.
    transformers' own window layer counts its length in a Python int, which a compiled step
    specialises on (one compilation per decoding step: measured on Mistral)."""

    is_sliding = True


def without_windows(cache: transformers.Cache, length: int) -> bool:
    """Replace ``cache``'s window layers by :class:`WindowLayer` s of ``length``; False (nothing
    replaced) when a window is shorter than ``length`` (the generation would slide it)."""
    windows = [i for i, layer in enumerate(cache.layers) if getattr(layer, "is_sliding", False)]
    if any(cache.layers[i].max_cache_len < length for i in windows):
        return False
    for i in windows:
        cache.layers[i] = WindowLayer(max_cache_len=length)
    return True


def cache_length(config: transformers.PretrainedConfig, width: int, new_tokens: int) -> int:
    """The cache a generation of ``new_tokens`` after prompts ``width`` wide decodes in: the prompt
    bucket plus ``new_tokens``, or the model's shortest attention window where the generation fits
    in it and the rounding alone would not (else the window would slide and the call decode eagerly:
    a Gemma 3 window of 1024, prompts of 600 tokens rounded to 1024, 256 new tokens). At most one
    more length per ``new_tokens``."""
    length = prompt_bucket(width) + new_tokens
    lazy = OneDtypeStaticCache(config=config, max_cache_len=length)  # its layers allocate on first use
    windows = [layer.max_cache_len for layer in lazy.layers if getattr(layer, "is_sliding", False)]
    window = min(windows, default=length)
    return window if width + new_tokens <= window < length else length


def batch_bucket(rows: int) -> int:
    """The batch ``rows`` decode in: the next power of two (a few graphs over any batch sizes; the
    padding rows cost at most as many as the real ones)."""
    return 1 << max(rows - 1, 0).bit_length()


class DecodingState:
    """What a model keeps for compiled decoding: one static cache per shape and its compiled call.
    A copy of the model (``copy.deepcopy``, or ``pickle`` / ``torch.save`` and a load: the lock and
    the compiled call do not pickle) starts with a new, empty one."""

    def __init__(self) -> None:
        self.caches: dict[tuple[Any, ...], transformers.Cache | None] = {}
        self.compiled: Callable | None = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> DecodingState:
        return DecodingState()

    def __reduce__(self) -> tuple[type[DecodingState], tuple[()]]:
        return DecodingState, ()

    def cache(
        self, model: transformers.PreTrainedModel, key: tuple[Any, ...], length: int
    ) -> transformers.Cache | None:
        """The cache of this shape, emptied for a new generation (allocated on first use); None when
        the model's windows are shorter than ``length`` (decoded eagerly)."""
        if key not in self.caches:
            self._drop_left(key)
            cache = OneDtypeStaticCache(config=model.config, max_cache_len=length)
            self.caches[key] = cache if without_windows(cache, length) else None
        cache = self.caches[key]
        if cache is not None:
            cache.reset()
        return cache

    def _drop_left(self, key: tuple[Any, ...]) -> None:
        """Drop the caches of a device or weight dtype other than ``key``'s (:func:`decode`'s
        ``key[3:5]``): the model has left it (moved, a second fit under another precision), so none
        of them serves it again, and each holds a whole generation's keys and values."""
        for old in [old for old in self.caches if old[3:5] != key[3:5]]:
            del self.caches[old]


_SHAPES: set[tuple[Any, ...]] = set()  # every (model class, shape, dtype) decoded in this process


def make_room(key: tuple[Any, ...]) -> None:
    """Every decoding shape is one entry of dynamo's cache for ``Module.__call__``, which stops
    compiling past ``recompile_limit`` entries (8) and runs eagerly from then on: the limit is
    raised to the shapes decoded in this process plus the default, never lowered."""
    _SHAPES.add(key)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < len(_SHAPES) + 8:
        setattr(config, name, len(_SHAPES) + 8)


_STATE = "_lightning_ppo_decoding"


def state_of(model: torch.nn.Module) -> DecodingState:
    """The model's :class:`DecodingState` (kept on the model: it lives and dies with it)."""
    state = model.__dict__.get(_STATE)
    if state is None:
        state = DecodingState()
        object.__setattr__(model, _STATE, state)  # not a submodule, not a parameter: a plain attribute
    return state


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model ``generate`` ends up in (PEFT wraps it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_unsharded(model: torch.nn.Module) -> None:
    """FSDP2's parameters are DTensors, gathered into new tensors at every ``generate``: a compiled
    step would capture one gathering's addresses. One line instead."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise UsageError(
            "generation.compile: true cannot decode a policy sharded by FSDP2 (its gathered weights "
            "are new tensors at every generate); set generation.compile: false, or use DDP"
        )


class FinishRows(transformers.LogitsProcessor):
    """The padding rows (``first`` on) emit ``stop_id`` at their first step, so they finish at once
    and never keep a generation running."""

    def __init__(self, first: int, stop_id: int) -> None:
        self.first, self.stop_id = first, stop_id

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        scores[self.first :] = float("-inf")
        scores[self.first :, self.stop_id] = 0.0
        return scores


@contextmanager
def _compiled_forward(model: torch.nn.Module, state: DecodingState, device: torch.device) -> Iterator[None]:
    """``generate`` on ``model`` calls the state's compiled forward for its decoding steps."""
    base = _base(model)
    if state.compiled is None:
        state.compiled = torch.compile(base.__call__, backend=_backend(device), dynamic=False)
    compiled = state.compiled
    base.get_compiled_call = lambda compile_config: compiled  # transformers' hook, for this call
    try:
        yield
    finally:
        del base.get_compiled_call


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def can_decode(model: transformers.PreTrainedModel) -> bool:
    """Whether the model decodes with a static cache (models with caches of their own do not)."""
    supported = getattr(_base(model), "_supports_default_dynamic_cache", None)
    return supported is not None and supported() and cache_argument(model) is not None


def decode(
    model: transformers.PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    generation_config: transformers.GenerationConfig,
    **generate_kwargs: Any,
) -> Tensor | None:
    """The new tokens ``generate`` samples after each left-padded prompt (``[rows, new]``), its
    decoding steps compiled. The batch is padded and the cache sized and kept as the module
    docstring says; extra ``generate_kwargs`` go to ``generate`` (a test's logits processor).
    None, having generated nothing, where the model's attention window is shorter than this call's
    cache (a compiled step would specialise on how full the window is): decode it eagerly."""
    check_unsharded(model)
    state = state_of(model)
    rows, width = prompt_ids.shape
    device = prompt_ids.device
    # One generate per model at a time (the caches are the model's). Never under inference mode
    # (``trainer.validate`` decodes under it): a cache allocated there would hold inference tensors,
    # which a later call outside it (a fit's rollouts) may not reset or write. ``no_grad`` after it:
    # leaving inference mode turns gradients on.
    with state.lock, torch.inference_mode(False), torch.no_grad():
        batch = batch_bucket(rows)
        length = cache_length(model.config, width, generation_config.max_new_tokens)
        dtypes = (next(model.parameters()).dtype, autocast_dtype(device))
        key = (type(_base(model)), batch, length, device, *dtypes)  # [3:5]: where the weights are
        cache = state.cache(model, key, length)
        if cache is None:
            return None
        make_room(key)
        ids, mask = prompt_ids, prompt_mask.long()
        processors = list(generate_kwargs.pop("logits_processor", None) or [])
        if batch > rows:
            extra = batch - rows
            ids = torch.cat([ids, ids[:1].expand(extra, -1)])
            mask = torch.cat([mask, mask[:1].expand(extra, -1)])
            processors.append(FinishRows(rows, generation_config.eos_token_id))
        with _compiled_forward(model, state, device):
            sequences = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=generation_config,
                logits_processor=transformers.LogitsProcessorList(processors),
                **{cache_argument(model) or "past_key_values": cache},
                **generate_kwargs,
            )
    return sequences[:rows, width:]
