"""How far apart two correct computations of one quantity may be: derived from the dtype they round
to and the size of the quantity, never from what one machine measured.

Two correct programs (compiled and eager decoding, a trimmed and an untrimmed cache, a padded and a
trimmed micro-batch, the AVX-512, AVX2 or scalar kernels ``ATEN_CPU_CAPABILITY`` selects) round in
other places and sum in other orders. Rounding ``x`` to a dtype of machine epsilon ``eps`` moves it
by at most ``eps / 2 * |x|`` (round to nearest), so two roundings of one value are at most one
*rounding step* apart, ``eps * |x|``. A tolerance is a stated number of such steps at the quantity's
magnitude, far below what a bug does: one prompt token masked away moves the tiny decoding models'
log-probs by 0.07-0.1 (measured), 7-16 times :func:`log_prob_tolerance` under bf16 and over
5 x 10^4 times it under float32.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch import Tensor


def magnitude(values: float | Tensor) -> float:
    """The largest ``|value|`` (a float is its own)."""
    return float(values.detach().abs().max()) if isinstance(values, Tensor) else abs(values)


def rounding_step(dtype: torch.dtype, values: float | Tensor) -> float:
    """One rounding step of ``dtype`` at the magnitude of ``values``: ``eps * max |value|``."""
    return torch.finfo(dtype).eps * magnitude(values)


def log_prob_tolerance(dtype: torch.dtype, logits: float | Tensor, log_probs: float | Tensor) -> float:
    """How far two correct programs' log-probs may be apart, where each program's logits were rounded
    to ``dtype`` (bf16 under bf16 autocast: the LM head's output; float32 otherwise) and the
    log-softmax ran in float32 (generation's scores and the loss's logits are cast up first).

    ``log p_t = z_t - logsumexp(z)``, whose gradient in ``z`` is ``onehot(t) - p``: its absolute
    values sum to ``2 (1 - p_t) <= 2``. Logits two programs round apart by at most one step each
    (``eps * max|z|``) thus move a log-prob by at most ``2 eps max|z|``; the float32 log-softmax
    rounds each program's result once more at the log-prob's own size, at most one float32 step
    apart from either side: ``2 eps_fp32 max|log p|``. The premise is that what the programs round
    apart before the logits (attention, the norms) moves them by less than their own last rounding.
    Measured on the four tiny families of tests/test_compiled_decoding.py under AVX-512, AVX2 and
    scalar kernels: at most 0.17 of a bf16 step of ``max|z|`` (bf16-mixed) and one float32 step
    of ``max|log p|`` (float32).
    """
    return 2 * rounding_step(dtype, logits) + 2 * rounding_step(torch.float32, log_probs)


class LargestLogit(Callback):
    """The largest ``|logit|`` any forward of the policy's LM head gave during a fit: what a log-prob
    tolerance scales with (:func:`log_prob_tolerance`)."""

    def __init__(self) -> None:
        self.value = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = pl_module.policy.get_output_embeddings()
        head.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, args: tuple, output: Tensor) -> None:
        self.value = max(self.value, magnitude(output))


# Two float32 programs computing one quantity in another order (a padded and a trimmed micro-batch,
# rows in groups, a compiled loss, another SIMD width) round each operation otherwise: up to one
# step per rounded operation at the magnitude it works at, adding along the chain of operations. For
# these tests' models (one or two layers, a forward and a backward: some sixteen rounded operations
# from a weight to a loss or a gradient) that is at most 16 steps; measured at most 4.5 under the
# AVX-512 and AVX2 kernels and 7.7 under the scalar ones (tests/test_compile_count.py's compiled
# gradients, each tensor at its own magnitude; 1.4-5.7 in the other files).
REORDERED_STEPS = 16


def reordered_tolerance(values: float | Tensor, terms: float = 0.0) -> float:
    """How far a float32 quantity computed in another order may be from ``values``:
    :data:`REORDERED_STEPS` rounding steps at the magnitude of ``values`` or of the ``terms`` it was
    summed from, the larger (a PPO loss sums ratio x whitened advantage, terms of size 1, to a mean
    that may cancel to near 0)."""
    return REORDERED_STEPS * torch.finfo(torch.float32).eps * max(magnitude(values), terms)
