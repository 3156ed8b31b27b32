"""The static key/value cache ``generate`` writes into (eager and compiled decoding), and the name a
model's forward takes a cache by."""

from __future__ import annotations

import inspect

import transformers
from torch import Tensor


class OneDtypeStaticCache(transformers.StaticCache):
    """HF's static cache, with each layer's keys stored in the dtype of the values written with them.

    Under autocast (bf16-mixed, 16-mixed) a RoPE model's keys leave the rotation in fp32 (its cos and
    sin are fp32) while its values come out of their projection in the low dtype. transformers up
    to 5.23 allocates both of a layer's tensors in the keys' dtype, and the values then fail to fit
    (``index_copy_(): ... Float and ... BFloat16``); 5.24 keeps fp32 keys beside low values. Attention
    under autocast casts the keys to the low dtype anyway, so casting them as they are stored changes
    no result (a test compares the samples with the dynamic cache's), on every version, and halves
    the keys' memory. Without autocast both already share one dtype and nothing is cast.

    ``trim`` (eager decoding): each step attends over the tokens written so far, not the whole
    cache. HF's static layers hand attention their whole length, the unwritten tail masked, so every
    step of a long generation attended over prompt + ``max_new_tokens`` positions, behind a mask
    built at that length before every step and never skipped (transformers keeps it for a
    compilable cache): measured on CPU (GPT-2 4 x 256, batch 8, one thread), that attention was a
    third of a step at 256 new tokens, and at 1024 the static cache decoded no faster than the
    dynamic one (9.6 and 9.2 ms a step; the dynamic one's cost is concatenating its whole cache at
    every step). Trimmed, and reporting itself not compilable so that transformers builds (or skips)
    the mask as for the dynamic cache: 6.7 ms (docs/performance.md, "Decoding"). The written length
    is counted on the host, so nothing is read back from the device. A cache with window (sliding,
    chunked) layers is not trimmed. Off for compiled decoding, whose graph needs the whole fixed
    length; the logits differ from the untrimmed cache's by rounding only (fp32 1e-7; one bf16 step).
    """

    def __init__(self, *args, trim: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Not with window layers: trimmed, the cache reports itself not compilable, transformers then
        # skips the mask of an unpadded batch, and an untrimmed window layer would attend over its
        # unwritten zeros (a review: other tokens than the dynamic cache's on a tiny Mistral).
        self.trim = trim and not any(
            getattr(layer, "is_sliding", False) for layer in getattr(self, "layers", [])
        )
        self.filled: dict[int, int] = {}  # tokens written per layer, counted on the host

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        key_states = key_states.to(value_states.dtype)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not self._trimmed(layer_idx):
            return keys, values
        filled = self.filled[layer_idx] = self.filled.get(layer_idx, 0) + key_states.shape[-2]
        return keys[:, :, :filled], values[:, :, :filled]

    def get_mask_sizes(self, query: int | Tensor, layer_idx: int) -> tuple[int, int]:
        if not self._trimmed(layer_idx):
            return super().get_mask_sizes(query, layer_idx)
        length = query if isinstance(query, int) else query.shape[0]  # transformers < 5: cache positions
        return self.filled.get(layer_idx, 0) + length, 0

    def reset(self) -> None:
        super().reset()
        self.filled = {}

    @property
    def is_compileable(self) -> bool:
        """Trimmed, it is not (its lengths change every step), and transformers then treats it as it
        treats the dynamic cache: each step's mask is built inside the forward, and skipped where no
        row has padding, instead of built at the cache's whole length before every step."""
        return not self.trim and super().is_compileable

    def _trimmed(self, layer_idx: int) -> bool:
        return self.trim


def cache_argument(model: transformers.PreTrainedModel) -> str | None:
    """The name ``generate`` takes a cache by, as the model's forward does: ``cache`` in newer
    transformers, ``past_key_values`` before (5.19, which vLLM 0.32 pins); None for neither."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    parameters = inspect.signature(type(base).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)
