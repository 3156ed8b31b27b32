"""``ppo.torch_compile``: the loss pass compiled once, whatever the micro-batches' lengths and shares.

``torch.compile`` guards what it specialised a graph on and compiles again when a guard fails, at
most ``torch._dynamo.config.recompile_limit`` (8) times per function: past it, every call runs
uncompiled. ``torch.compile(module.ppo_loss)`` alone (before this module) compiled 8 times in the
quickstart's first iteration and ran every later loss pass eagerly, because the pass specialised on

* the micro-batch's shape: row groups and trimming give each micro-batch its own rows and columns.
  Here they are marked dynamic (``maybe_mark_dynamic``): one graph serves every size;
* sizes 0 and 1, which torch always specialises (a dynamic size is assumed to be >= 2): a group of
  one row, a response column of one token (every response of the group one token long), a prompt
  of one column (``logits_to_keep`` then keeps every position, another path). Here a micro-batch
  of one row runs it twice over and responses and prompts are padded to 2 columns with masked
  positions, so no size is ever 1 (:func:`for_compiled`). Every loss term and statistic is a mean
  or a share-weighted sum: a repeated row leaves each unchanged, masked positions take part in none;
* the number of 8-row chunks of the vocabulary-wide reductions (``functional._ROWS_PER_CHUNK``):
  compiled, they run in one piece (inductor fuses the float copy chunking bounds in eager mode);
* Python floats: each micro-batch's :class:`Share` (and ``weighted``'s ``share == 1.0`` branch)
  and ``kl_ctl.value``, which changes every iteration with ``kl_target`` and ``kl_placement:
  loss``. They enter as one (4,) float32 tensor, copied to the device without waiting on it.

Two Hugging Face / PEFT details broke the graph at every pass with ``gradient_checkpointing``:
the ``use_cache`` warning that transformers logs from inside the forward (dynamo cannot trace a
logger; here a no-op while tracing), and, with LoRA, the forward hooks HF and PEFT install on the
input embeddings to make their output require gradients (``requires_grad_`` on an intermediate
breaks the graph inside PEFT's forward context, so the whole forward fell back to a graph per
block: 97 in one run). Those hooks only matter to reentrant checkpointing; the roles checkpoint
non-reentrantly (models.roles), so they are removed when the loss is compiled.

Compiled passes agree with eager ones to float32 rounding (tests/test_compile.py); with
``ppo.torch_compile`` off nothing here runs. ``BACKEND`` is torch.compile's backend: tests and
benchmarks/compile_count.py count compilations with ``eager`` (dynamo's guards and graphs, no code
generation), which specialises and recompiles exactly as inductor does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ppo.ppo.experience import Experience
from lightning_ppo.ppo.microbatches import Share

BACKEND = "inductor"
# The least size of a dimension that torch does not specialise on.
LEAST = 2
# Experience's (B, L) tensors (prompt and response); its other 2-d tensors are (B, R).
SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")
# Padded with their edge column (a real token id, a position), not with zeros.
LEFT_EDGE = ("input_ids",)
RIGHT_EDGE = ("input_ids", "response_ids", "position_ids")


class CompiledLoss:
    """``loss(mb, share, kl_coef)`` under ``torch.compile``, called as ``(mb, share)``; ``kl_coef()``
    reads the coefficient of the moment. ``roles``: the modules whose input-gradient hooks go."""

    def __init__(self, loss: Callable, kl_coef: Callable[[], float], roles: nn.Module) -> None:
        def weighed(mb: Experience, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            tokens, responses, rows, kl = weights.unbind()
            return loss(mb, Share(tokens, responses, rows), kl)

        self.compiled = torch.compile(weighed, backend=BACKEND)
        self.kl_coef = kl_coef
        drop_input_grad_hooks(roles)

    def __call__(self, mb: Experience, share: Share) -> tuple[Tensor, dict[str, Tensor]]:
        weighing = [share.tokens, share.responses, share.rows, self.kl_coef()]
        weights = torch.tensor(weighing, dtype=torch.float32).to(mb.input_ids.device, non_blocking=True)
        with silent_loggers():
            return self.compiled(for_compiled(mb), weights)


def for_module(module: Any) -> CompiledLoss:
    """A PPOLightningModule's ``ppo_loss`` compiled, with the KL coefficient its ``kl_ctl`` holds at
    each call (a checkpoint may replace the controller)."""
    return CompiledLoss(module.ppo_loss, lambda: module.kl_ctl.value, module.roles)


def for_compiled(mb: Experience) -> Experience:
    """``mb`` with at least :data:`LEAST` rows (a single row repeated), prompt columns (masked ones
    before) and response columns (masked ones after), contiguous, rows and columns marked dynamic."""
    rows, width = mb.response_ids.shape
    repeat = -(-LEAST // rows) if rows else 1
    before = max(LEAST - (mb.input_ids.shape[1] - width), 0)
    after = max(LEAST - width, 0)
    values = {}
    for f in fields(mb):
        value = getattr(mb, f.name)
        if value is None:
            values[f.name] = None
            continue
        if repeat > 1:
            value = value.repeat(repeat, *(1,) * (value.dim() - 1))
        if value.dim() == 2 and (after or (before and f.name in SEQUENCE_FIELDS)):
            parts = [value]
            if before and f.name in SEQUENCE_FIELDS:
                parts.insert(0, _edge(value[:, :1], f.name in LEFT_EDGE).expand(-1, before))
            if after:
                parts.append(_edge(value[:, -1:], f.name in RIGHT_EDGE).expand(-1, after))
            value = torch.cat(parts, dim=1)
        value = value.contiguous()
        for dim in range(value.dim()):
            torch._dynamo.maybe_mark_dynamic(value, dim)
        values[f.name] = value
    return Experience(**values)


def _edge(column: Tensor, keep: bool) -> Tensor:
    return column if keep else torch.zeros_like(column)


def drop_input_grad_hooks(model: nn.Module) -> None:
    """Remove the forward hooks that make an input embedding's output require gradients
    (``enable_input_require_grads``: HF's ``gradient_checkpointing_enable`` and PEFT each install
    one, and HF keeps a handle to the last only)."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
                for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs):
                    hooks.pop(key, None)  # as the hook's RemovableHandle.remove() would


def silent_loggers() -> AbstractContextManager:
    """transformers' ``logger.warning_once`` as a no-op while dynamo traces (else a graph break)."""
    try:
        from transformers.utils.logging import warning_once
    except ImportError:  # pragma: no cover - transformers is a dependency
        return nullcontext()
    ignored = torch._dynamo.config.ignore_logging_functions | {warning_once}
    return torch._dynamo.config.patch(ignore_logging_functions=ignored)
