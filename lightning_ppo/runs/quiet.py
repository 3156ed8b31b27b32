"""Silence the messages a PPO run causes on purpose, each at its source and by its exact text.

Each of these appeared in every ``lightning-ppo fit`` and says nothing the user can act on:

- Lightning's "Found N module(s) in eval mode at the start of training": the frozen roles
  (reference, reward model) are in eval mode by design, so dropout stays off.
- Lightning's "💡 Tip: ... litlogger" advertisement, printed by every Trainer.
- Lightning's "The 'train_dataloader' does not have many workers" (and the val one's), on any
  machine of more than a few cores: a prompt batch is a few token rows, the rollout bounds the
  iteration, and ``num_workers: 0`` is what lets ``PromptDataModule`` resume mid-epoch exactly.
- Lightning's Tensor Cores advice on a GPU under ``32-true``: TF32 matmuls would move the
  log-probs that the ratio and the KL compare by ~1e-3; ``bf16-mixed`` is the fast path on GPUs
  (docs/performance.md), and a user who wants TF32 sets ``torch.set_float32_matmul_precision``.
- Lightning's own use of a deprecated torch pytree API (``isinstance(treespec, LeafSpec)``).
- transformers' "We strongly recommend passing in an `attention_mask`" during generation: we do
  pass it; transformers drops an all-ones mask itself and then warns when a finished response
  emits the pad token (see :func:`quiet_generation`).

Lightning's messages that are false for this package (the one that applies is said instead):

- "Total length of `list` across ranks is zero": ``PromptDataModule.val_dataloader`` returns ``[]``
  when there is no validation set, which is a choice, not an accident.
- "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not
  resumable ... unreliable results": ``PromptDataModule``'s sampler resumes mid-epoch exactly
  (with ``num_workers: 0``; dropped only then, see :func:`exact_mid_epoch_resume`).
- "`Trainer.fit` stopped: `max_epochs=1` reached" after a run stopped mid-epoch (Ctrl-C,
  ``max_time``): the checkpoint callback has said why it stopped (:func:`stopped_mid_epoch`).

With ``generation.engine: vllm`` (see :func:`quiet_vllm`): vLLM logs at WARNING and above unless
``VLLM_LOGGING_LEVEL`` says otherwise, and its warnings about choices this package makes on
purpose are dropped: the tied LM head's "Failed to load weights" on every push (the head is
repacked from the loaded weights), the chat-template warm-up traceback (no tokenizer is loaded:
prompts are token ids), "Using None for EOS token id" (the stop token is passed per request),
the global-seed warning (every vLLM call runs in a fork of the process's RNGs) and the two
about ``enforce_eager``.

Every other warning is kept. ``LIGHTNING_PPO_VERBOSE=1`` keeps these too.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

VERBOSE_ENV = "LIGHTNING_PPO_VERBOSE"

_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Total length of `list` across ranks is zero",
    r"The '\w+' does not have many workers which may be a bottleneck",
)
_MID_EPOCH_RESUME = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader"
_LIGHTNING_LOGGER = "lightning.pytorch.utilities.rank_zero"  # rank_zero_info's
_LIGHTNING_ADVICE = (_LIGHTNING_LOGGER, ("💡 Tip:", "You are using a CUDA device ("))
_MAX_EPOCHS_REACHED = "`Trainer.fit` stopped: `max_epochs="
# (logger, message prefix): a filter on the logger that emits the record drops it before any
# handler sees it, whenever vLLM (re)configures its handlers.
_VLLM_OURS = (
    ("vllm.model_executor.model_loader.reload.layerwise", "ParallelLMHead: Failed to load weights"),
    ("vllm.renderers.base", "Chat template warmup failed"),
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized"),
    ("vllm.engine.arg_utils", "The global random seed is set to"),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
)
_MISSING_MASK = ("transformers.modeling_utils", "We strongly recommend passing in an `attention_mask`")


class DropMessages(logging.Filter):
    """A logging filter that drops records whose message starts with ``prefix`` (or one of them)."""

    def __init__(self, prefix: str | tuple[str, ...]) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


_installed = False


def silence_intended_warnings() -> None:
    """Install the filters for Lightning's messages above (once per process)."""
    global _installed
    if _installed or verbose():
        return
    _installed = True
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    name, prefix = _LIGHTNING_ADVICE
    logging.getLogger(name).addFilter(DropMessages(prefix))


def exact_mid_epoch_resume() -> None:
    """Drop Lightning's warning that a mid-epoch resume "can cause unreliable results": called by a
    train DataLoader that resumes exactly (``PromptDataModule``'s, with ``num_workers: 0``)."""
    if not verbose():
        warnings.filterwarnings("ignore", message=_MID_EPOCH_RESUME)


def stopped_mid_epoch() -> DropMessages:
    """Drop Lightning's "`max_epochs=N` reached" line until the filter returned is removed
    (:func:`stop_dropping`): said when a run stopped before the end of its epoch."""
    dropper = DropMessages(_MAX_EPOCHS_REACHED)
    if not verbose():
        logging.getLogger(_LIGHTNING_LOGGER).addFilter(dropper)
    return dropper


def stop_dropping(dropper: DropMessages | None) -> None:
    if dropper is not None:
        logging.getLogger(_LIGHTNING_LOGGER).removeFilter(dropper)


@contextmanager
def quiet_generation() -> Iterator[None]:
    """Drop transformers' missing-attention-mask warning while HF ``generate`` runs."""
    if verbose():
        yield
        return
    name, prefix = _MISSING_MASK
    logger, dropper = logging.getLogger(name), DropMessages(prefix)
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def quiet_vllm() -> None:
    """Before vLLM is imported: its INFO lines (dozens at start-up, two per weight push) off unless
    asked for, and its warnings about this package's own choices (above) dropped."""
    global _vllm_quiet
    if _vllm_quiet or verbose():
        return
    _vllm_quiet = True
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name, prefix in _VLLM_OURS:
        logging.getLogger(name).addFilter(DropMessages(prefix))


_vllm_quiet = False
