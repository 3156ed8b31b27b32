"""Silence the messages a PPO run causes on purpose, each at its source and by its exact text.

Each of these appeared in every ``lightning-ppo fit`` and says nothing the user can act on:

- Lightning's "Found N module(s) in eval mode at the start of training": the frozen roles
  (reference, reward model) are in eval mode by design, so dropout stays off.
- Lightning's "💡 Tip: ... litlogger" advertisement, printed by every Trainer.
- Lightning's own use of a deprecated torch pytree API (``isinstance(treespec, LeafSpec)``).
- transformers' "We strongly recommend passing in an `attention_mask`" during generation: we do
  pass it; transformers drops an all-ones mask itself and then warns when a finished response
  emits the pad token (see :func:`quiet_generation`).

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
)
_LIGHTNING_TIP = ("lightning.pytorch.utilities.rank_zero", "💡 Tip:")
_MISSING_MASK = ("transformers.modeling_utils", "We strongly recommend passing in an `attention_mask`")


class DropMessages(logging.Filter):
    """A logging filter that drops records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
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
    name, prefix = _LIGHTNING_TIP
    logging.getLogger(name).addFilter(DropMessages(prefix))


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
