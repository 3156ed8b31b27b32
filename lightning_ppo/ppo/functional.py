"""Pure tensor math for PPO on language models.

Nothing here knows about Lightning or transformers: every function takes tensors and returns
tensors (or a small dataclass of tensors), so each formula can be tested against hand-computed
numbers. Shapes use B = batch, T = response length, V = vocabulary size.

Masks are boolean and *positive*: True on real response tokens. Positions where the mask is
False never contribute to a mean and always come out as 0, whatever garbage they held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
ISLevel = Literal["token", "sequence"]
GroupEstimator = Literal["grpo", "rloo"]
# Sums a tensor over every data-parallel rank (torch.distributed's all-reduce, through the
# Trainer's strategy). Statistics that steer training take one, so that every rank whitens,
# normalises and decides from the same global numbers; ``None`` means this process's data only.
Reduce = Callable[[Tensor], Tensor]

# Rows of a (B, T, V) logits tensor processed at once by the vocabulary-wide reductions: bounds
# the temporary (rows, T, V) float32 buffer that log_softmax/softmax would otherwise allocate for
# the whole batch.
_ROWS_PER_CHUNK = 8


def masked_mean(
    x: Tensor, mask: Tensor | TokenMask, dim: int | None = None, reduce: Reduce | None = None
) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 where nothing is masked in).

    With ``reduce``, the mean over every rank's masked-in positions (``dim`` must be None). A
    :class:`TokenMask` shares its complement and count between several means over one mask.
    """
    if isinstance(mask, TokenMask) and dim is None and reduce is None:
        return mask.mean(x)
    mask = mask.mask if isinstance(mask, TokenMask) else mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x))
    if dim is not None:
        if reduce is not None:
            raise ValueError("masked_mean: a per-row mean (dim) is never reduced across ranks")
        return total.sum(dim) / mask.sum(dim).clamp(min=1)
    if reduce is None:
        return total.sum() / mask_count(mask)
    sums = reduce(torch.stack([total.sum(), mask.sum().to(total.dtype)]))
    return sums[0] / sums[1].clamp(min=1)


def mask_count(mask: Tensor) -> Tensor:
    """The divisor of :func:`masked_mean`: the masked-in positions, at least 1."""
    return mask.sum().clamp(min=1)


@dataclass(frozen=True)
class TokenMask:
    """A mask and what every mean over it shares, computed once: the positions to zero and the
    count to divide by. A micro-batch's loss, and an iteration's statistics, take several means over
    one mask; on a GPU each op saved is a kernel launch saved. :meth:`mean` is :func:`masked_mean`,
    bit for bit."""

    mask: Tensor
    padding: Tensor  # ~mask
    count: Tensor  # mask_count(mask)

    @classmethod
    def of(cls, mask: Tensor | TokenMask) -> TokenMask:
        if isinstance(mask, TokenMask):
            return mask
        mask = mask.bool()
        return cls(mask, ~mask, mask_count(mask))

    def mean(self, x: Tensor) -> Tensor:
        """The mean of ``x`` over the mask; padding zeroed, so its NaN/garbage never reaches the sum."""
        return self.zeroed(x).sum() / self.count

    def zeroed(self, x: Tensor) -> Tensor:
        """``x`` with 0 on the padding."""
        return x.masked_fill(self.padding, 0.0)


def masked_var(
    x: Tensor, mask: Tensor | TokenMask, unbiased: bool = True, reduce: Reduce | None = None
) -> Tensor:
    """Variance of ``x`` over the masked-in positions (a scalar); with ``reduce``, of every rank's.

    Two passes (mean, then squared deviations from it), as numerically safe across ranks as in one.
    """
    if reduce is None:
        tokens = TokenMask.of(mask)  # one complement and count for both means
        mean = tokens.mean(x)
        var = tokens.mean(tokens.zeroed(x - mean).square())
        # a count clamped at 1 takes the same branch below as the raw count
        count = tokens.count if unbiased else None
    else:
        mask = mask.mask if isinstance(mask, TokenMask) else mask.bool()
        mean = masked_mean(x, mask, reduce=reduce)
        centered = torch.where(mask, x - mean, torch.zeros_like(x))
        var = masked_mean(centered.square(), mask, reduce=reduce)
        count = reduce(mask.sum().to(var.dtype)) if unbiased else None
    if count is not None:
        # Bessel's correction; a single element has no spread to correct.
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)
    return var


def masked_whiten(
    x: Tensor,
    mask: Tensor | TokenMask,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Reduce | None = None,
) -> Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) over the mask.

    With ``reduce`` the mean and variance are those of every rank's masked-in positions (the
    global batch, as verl and OpenRLHF normalise): per-rank statistics would give each rank its
    own baseline. Masked-out positions are returned as 0 so that they cannot leak into a later sum.
    """
    tokens = TokenMask.of(mask)
    mean = masked_mean(x, tokens, reduce=reduce)
    var = masked_var(x, tokens, reduce=reduce)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return tokens.zeroed(whitened)


def logprobs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, suppressed: Sequence[int] = ()
) -> Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    Args:
        logits: (..., V) unnormalised scores; position i scores ``tokens[..., i]``.
        tokens: (...) token ids, same leading shape as ``logits``.
        temperature: the sampling temperature; log-probs must use the one sampling used.
        suppressed: token ids that sampling never draws (their logits set to -inf, as HF's
            ``suppress_tokens`` does): the softmax runs over the other tokens only.

    Returns:
        (...) float tensor, the shape of ``tokens``.

    Computed as ``logit[token] - logsumexp(logits)`` a few rows at a time, so no second
    vocabulary-sized tensor is materialised for the whole batch.
    """
    if temperature != 1.0:
        logits = logits / temperature
    flat_logits = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits[None]
    flat_tokens = tokens.reshape(-1, tokens.shape[-1]) if tokens.dim() > 1 else tokens[None]

    def chunk(rows: Tensor, toks: Tensor) -> Tensor:
        rows = suppress(rows.float(), suppressed, float("-inf"))
        picked = rows.gather(-1, toks.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(rows, dim=-1)

    if torch.compiler.is_compiling() or len(flat_logits) <= _ROWS_PER_CHUNK:  # see _ROWS_PER_CHUNK
        return chunk(flat_logits, flat_tokens).reshape(tokens.shape)
    pieces = zip(flat_logits.split(_ROWS_PER_CHUNK), flat_tokens.split(_ROWS_PER_CHUNK), strict=True)
    return torch.cat([chunk(rows, toks) for rows, toks in pieces]).reshape(tokens.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, suppressed: Sequence[int] = ()) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension, shape ``logits.shape[:-1]``.

    ``suppressed`` token ids are left out of the distribution, as in :func:`logprobs_from_logits`.
    """
    if temperature != 1.0:
        logits = logits / temperature
    flat = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits[None]

    def chunk(rows: Tensor) -> Tensor:
        rows = rows.float()
        masked = suppress(rows, suppressed, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        # Suppressed tokens have probability 0; a finite logit there keeps 0 x logit (and its
        # gradient) at 0, where 0 x -inf would be NaN.
        return torch.logsumexp(masked, dim=-1) - (probs * suppress(rows, suppressed, 0.0)).sum(-1)

    if torch.compiler.is_compiling() or len(flat) <= _ROWS_PER_CHUNK:  # see _ROWS_PER_CHUNK
        return chunk(flat).reshape(logits.shape[:-1])
    return torch.cat([chunk(rows) for rows in flat.split(_ROWS_PER_CHUNK)]).reshape(logits.shape[:-1])


def suppress(logits: Tensor, suppressed: Sequence[int], value: float) -> Tensor:
    """``logits`` with the ``suppressed`` vocabulary columns set to ``value`` (a copy; autograd-safe)."""
    if len(suppressed) == 0:
        return logits
    index = torch.as_tensor(suppressed, dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, index, value)


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator = "k1",
    mask: Tensor | TokenMask | None = None,
) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    ``k1`` = logp - ref (unbiased, can be negative), ``k2`` = 0.5 (logp - ref)^2,
    ``k3`` = exp(ref - logp) - 1 - (ref - logp) (unbiased and non-negative, Schulman's estimator).
    With ``mask``, 0 on padding, with gradient 0 there (:func:`masked_log_ratio`).
    """
    log_ratio = logprobs - ref_logprobs if mask is None else masked_log_ratio(logprobs, ref_logprobs, mask)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")


def masked_log_ratio(logprobs: Tensor, other: Tensor, mask: Tensor | TokenMask) -> Tensor:
    """``logprobs - other`` on real tokens, 0 on padding, selected before any other op reads it.

    Padding may hold a log-prob of -inf: the pad token, when it is suppressed, has logit -inf. A
    later mask that multiplies or zeroes the *result* (k3's ``exp(-x) + x``, k2's ``x^2``) gives a
    forward 0 there but a backward 0 x inf = NaN: the gradient of a select is 0 on the side not
    taken, and only a select of the *input* keeps the non-finite value out of every derivative.
    """
    mask = mask.mask if isinstance(mask, TokenMask) else mask.bool()
    difference = logprobs - other
    return torch.where(mask, difference, torch.zeros_like(difference))


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked-in positions of each row.

    Args:
        rewards: (B, T) per-token rewards.
        values: (B, T) value estimates of the state before each token.
        mask: (B, T) True on real tokens. Masked positions are skipped: their reward and value
            are never read, and they receive advantage 0 and return 0.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, each (B, T), with ``returns = advantages + values`` on real tokens.
    """
    mask = mask.bool()
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.where(mask, values, torch.zeros_like(values))
    zero = torch.zeros_like(values[:, 0])  # one column of zeros, read (never written) by every step
    next_value = next_advantage = zero
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(real, delta + gamma * lam * next_advantage, zero)
        advantages[:, t] = advantage
        # Carry the bootstrap across padding: a masked position must not reset or shift it.
        next_advantage = torch.where(real, advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


@dataclass
class PolicyLossOutput:
    """The clipped surrogate loss and the statistics users log (all scalars, stats detached)."""

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    ratio: Tensor


LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses become one number (the names of TRL's ``loss_type`` in brackets):

    * ``token_mean``: the sum over every real token of the minibatch divided by their number: each
      token weighs the same, long responses weigh more (DAPO, Yu et al., 2025; TRL's ``dapo``,
      its default; PPO as TRL's PPOTrainer and OpenRLHF compute it).
    * ``sequence_mean``: each response's token mean, then the mean over responses: each response
      weighs the same, a token of a short one more (GRPO as first published, Shao et al., 2024;
      TRL's ``grpo``).
    * ``constant``: the sum over real tokens divided by responses x ``constant`` (the response
      length budget): neither length bias (Dr. GRPO, Liu et al., 2025; TRL's ``dr_grpo``).
    """

    mode: str = "token_mean"
    constant: float | None = None

    def __call__(self, per_token: Tensor, mask: Tensor | TokenMask) -> Tensor:
        if self.mode == "token_mean":
            return TokenMask.of(mask).mean(per_token)
        mask = mask.mask if isinstance(mask, TokenMask) else mask.bool()
        kept = torch.where(mask, per_token, torch.zeros_like(per_token))
        if self.mode == "sequence_mean":
            rows = mask.any(dim=1)
            per_row = kept.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            return (per_row * rows).sum() / rows.sum().clamp(min=1)
        if self.mode == "constant" and self.constant:
            return kept.sum() / (mask.shape[0] * self.constant)
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS} (constant > 0), got {self}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor | TokenMask,
    clip_range: float | tuple[float, float],
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
    aggregate: Aggregation = Aggregation(),
) -> PolicyLossOutput:
    """PPO clipped surrogate: ``max(-A r, -A clip(r, 1 - e_low, 1 + e_high))`` per token, aggregated.

    ``clip_range`` is ``e`` for both sides or ``(e_low, e_high)``: a larger ``e_high`` lets
    unlikely tokens with positive advantages grow more ("clip-higher", DAPO, Yu et al., 2025).
    With ``dual_clip = c > 1`` (Ye et al., 2020), the per-token loss of a negative advantage is
    also capped at ``-c A``, so a huge ratio on a bad action cannot blow the update up.
    ``is_weights`` (detached, see :func:`truncated_is_weights`) multiply each token's loss.
    ``aggregate`` turns the per-token losses into the loss (:class:`Aggregation`).
    ``approx_kl`` is 0.5 (log r)^2 averaged over real tokens, ``clipfrac`` the fraction of real
    tokens where the clipped term was the larger one, ``ratio`` the mean of r.
    """
    low, high = clip_range if isinstance(clip_range, tuple) else (clip_range, clip_range)
    tokens = TokenMask.of(mask)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, tokens)
    ratio = torch.exp(log_ratio)
    negated = -advantages  # once for both terms
    unclipped = negated * ratio
    clipped = negated * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, tokens)
    with torch.no_grad():
        return PolicyLossOutput(
            loss=loss,
            clipfrac=tokens.mean((clipped > unclipped).float()),
            approx_kl=0.5 * tokens.mean(log_ratio.square()),
            ratio=tokens.mean(ratio),
        )


def engine_log_ratio(logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, level: ISLevel) -> Tensor:
    """(B, T) log(p_trainer / p_engine) of the sampled tokens, 0 on padding.

    ``sequence``: every token of a row carries the row's summed log-ratio (the log of the
    sequence's probability ratio).
    """
    log_ratio = torch.where(mask.bool(), logprobs - engine_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return log_ratio
    if level == "sequence":
        return log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    raise ValueError(f"importance sampling level must be 'token' or 'sequence', got {level!r}")


def truncated_is_weights(
    logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, level: ISLevel, cap: float
) -> Tensor:
    """(B, T) truncated importance weights ``min(exp(logp_trainer - logp_engine), cap)``, detached.

    The engine sampled the tokens but the trainer's log-probs are what PPO optimises: the weights
    correct the loss for the two distributions' difference, as TRL's vLLM colocate mode does;
    truncation bounds the variance. 0 on padding.
    """
    with torch.no_grad():
        weights = torch.exp(engine_log_ratio(logprobs, engine_logprobs, mask, level)).clamp(max=cap)
        return torch.where(mask.bool(), weights, torch.zeros_like(weights))


@dataclass
class ValueLossOutput:
    """The clipped value loss and the fraction of real tokens where clipping was binding."""

    loss: Tensor
    clipfrac: Tensor


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor | TokenMask, clip_range: float
) -> ValueLossOutput:
    """0.5 x masked mean of ``max((v - R)^2, (v_clipped - R)^2)``, v clipped to ``old +- clip_range``."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_err = (values - returns).square()
    clipped_err = (clipped_values - returns).square()
    tokens = TokenMask.of(mask)
    loss = 0.5 * tokens.mean(torch.maximum(unclipped_err, clipped_err))
    with torch.no_grad():
        clipfrac = tokens.mean((clipped_err > unclipped_err).float())
    return ValueLossOutput(loss=loss, clipfrac=clipfrac)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor | TokenMask) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over real tokens (1 is a perfect critic)."""
    mask = TokenMask.of(mask)
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    return 1.0 - var_residual / var_returns.clamp(min=1e-8)


def group_advantages(
    scores: Tensor,
    group_size: int,
    estimator: GroupEstimator,
    eps: float = 1e-6,
    valid: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """Critic-free sequence advantages from groups of completions of the same prompt.

    ``scores`` is (B,) with the ``group_size`` completions of each prompt next to each other.
    ``grpo``: (s - group mean) / (group std + eps), the std unbiased (Shao et al., 2024).
    ``rloo``: s minus the mean of the *other* completions of its prompt (Ahmadian et al., 2024).
    ``valid`` (B,) bool: completions to learn from; the others (a reward's NaN, dropped) are left
    out of their group's mean and std, as TRL's nanmean/nanstd do, and get advantage 0. A group
    with fewer than two valid completions has no baseline: its advantages are 0.
    ``scale`` (``grpo`` only) replaces the group std as the divisor: the batch's std (TRL's
    ``scale_rewards: batch``) or 1 (``none``, Dr. GRPO: no division).
    """
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError(f"advantage_estimator {estimator!r} needs num_generations >= 2, got {group_size}")
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"group estimator must be 'grpo' or 'rloo', got {estimator!r}")
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    groups = torch.where(valid, scores, torch.zeros_like(scores)).reshape(-1, group_size)
    kept = valid.reshape(-1, group_size)
    count = kept.sum(dim=1, keepdim=True)
    total = groups.sum(dim=1, keepdim=True)
    mean = total / count.clamp(min=1)
    if estimator == "grpo":
        squares = torch.where(kept, groups - mean, torch.zeros_like(groups)).square().sum(dim=1, keepdim=True)
        std = (squares / (count - 1).clamp(min=1)).sqrt()
        advantages = (groups - mean) / (std + eps if scale is None else scale)
    else:
        advantages = groups - (total - groups) / (count - 1).clamp(min=1)
    usable = kept & (count >= 2)
    return torch.where(usable, advantages, torch.zeros_like(advantages)).reshape(-1)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """(B, T) reward-to-go ``sum_k gamma^k r_{t+k}`` over real tokens; 0 on padding."""
    mask = mask.bool()
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    zero = running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, zero)
    return returns
