"""The experience of one PPO iteration: everything the inner epochs train on.

``make_experience`` is pure math on tensors (KL penalty, rewards, GAE, whitening); the forwards
that produce its inputs live in the module. Shapes: B sequences, P prompt tokens, R response
tokens, L = P + R.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from lightning_ppo.config import PPOConfig
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.rollout_data import Rollout


@dataclass
class Experience:
    """Rollout tensors plus the quantities PPO computed from them (no gradients anywhere)."""

    input_ids: Tensor  # (B, L) prompt + response
    attention_mask: Tensor  # (B, L) bool
    position_ids: Tensor  # (B, L)
    response_ids: Tensor  # (B, R)
    response_mask: Tensor  # (B, R) bool, True up to and including the stop token
    logprobs: Tensor  # (B, R) under the rollout policy, at the sampling temperature
    ref_logprobs: Tensor  # (B, R) under the frozen reference
    values: Tensor  # (B, R) critic estimates before each response token
    scores: Tensor  # (B,) reward per sequence (after the missing-EOS penalty)
    kl: Tensor  # (B, R) per-token KL estimate, 0 on padding
    rewards: Tensor  # (B, R) -kl_coef * kl, plus the score at the last real token
    advantages: Tensor  # (B, R) GAE advantages (whitened if configured), 0 on padding
    returns: Tensor  # (B, R) advantages + values before whitening, 0 on padding
    # (B, R) truncated engine-vs-trainer importance weights of the policy loss; None without them
    is_weights: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: Tensor) -> Experience:
        """The rows ``index`` of every tensor."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{name: None if v is None else v[index] for name, v in values.items()})

    def minibatches(
        self, num: int, generator: torch.Generator | None = None, epochs: int = 1
    ) -> Iterator[Experience]:
        """``epochs`` passes of ``num`` equal, disjoint minibatches, each pass in a new random order
        (the rows of :func:`minibatch_rows`)."""
        rows = minibatch_rows(len(self), num, generator, epochs)
        # One host-to-device copy for all passes.
        index = torch.from_numpy(np.concatenate(rows)).to(self.input_ids.device)
        for part in index.split([len(r) for r in rows]):
            yield self.select(part)

    def padding_bounds(self) -> Tensor:
        """(2,) on the device: the first column any row attends to and the last one, for
        :meth:`trimmed` (stacked with others' bounds, several micro-batches cost one host read)."""
        length = self.input_ids.shape[1]
        real = self.attention_mask.any(dim=0)
        columns = torch.arange(length, device=real.device)
        return torch.stack([columns.masked_fill(~real, length).min(), columns.masked_fill(~real, -1).max()])

    def trimmed(self, bounds: list[int] | None = None) -> Experience:
        """The same rows without the columns that are padding in every one of them: the prompt's
        left padding shared by all rows, and the response's right padding past the longest.

        Exact: a causal LM's output at a real position does not depend on later positions, and
        masked columns are only ever masked (positions count real tokens). A minibatch of short
        responses then pays for its own longest, not the whole batch's. ``bounds`` are
        :meth:`padding_bounds` already read to the host; without them this reads them (one sync).
        """
        length, width = self.input_ids.shape[1], self.response_ids.shape[1]
        prompt = length - width
        first, last = bounds if bounds is not None else self.padding_bounds().tolist()
        first, last = min(first, prompt), max(last + 1 - prompt, 1)
        if first == 0 and last == width:
            return self
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.dim() == 2 and value.shape[1] == length:
                value = value[:, first : prompt + last].contiguous()  # kernels run faster on it
            elif value is not None and value.dim() == 2 and value.shape[1] == width:
                value = value[:, :last].contiguous()
            values[f.name] = value
        return Experience(**values)

    def split(self, num: int) -> Iterator[Experience]:
        """``num`` consecutive micro-batches (for gradient accumulation)."""
        if num == 1:
            yield self  # no accumulation: no copy
            return
        for index in torch.arange(len(self), device=self.input_ids.device).chunk(num):
            yield self.select(index)


def minibatch_rows(
    size: int, num: int, generator: torch.Generator | None = None, epochs: int = 1
) -> list[np.ndarray]:
    """The rows of ``epochs`` passes of ``num`` equal, disjoint minibatches of ``size`` rows, each pass
    a new random permutation cut as ``Tensor.chunk`` cuts (the last minibatch may be smaller).

    Drawn on the host straight into NumPy arrays: the update plans its micro-batches from them
    without reading any tensor (lightning_ppo.ppo.microbatches).
    """
    passes = []
    for _ in range(epochs):
        order = np.empty(size, dtype=np.int64)
        torch.randperm(size, generator=generator, out=torch.from_numpy(order))
        passes.append(order)
    step = -(-size // num)  # Tensor.chunk's size: ceil(size / num)
    return [order[start : start + step] for order in passes for start in range(0, size, step)]


def last_token_index(response_mask: Tensor) -> Tensor:
    """(B,) index of the last True of each row (the stop token, or the last of a truncated response;
    the last action of a multi-turn episode, whose mask has gaps); 0 for an empty row."""
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return ((response_mask.long() * positions).amax(dim=1) - 1).clamp(min=0)


def make_experience(
    rollout: Rollout,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    values: Tensor,
    scores: Tensor,
    kl_coef: float,
    config: PPOConfig,
    is_weights: Tensor | None = None,
    reduce: F.Reduce | None = None,
) -> Experience:
    """Turn a rollout, its log-probs, values and scores into per-token rewards, advantages, returns.

    With a critic-free estimator pass ``values`` as zeros: they are neither read nor trained.
    ``is_weights`` (engine-vs-trainer importance weights) are carried to the policy loss.
    ``reduce`` sums over the data-parallel ranks: whitening then uses the global batch's statistics.
    """
    mask = rollout.response_mask
    if config.missing_eos_penalty is not None:
        scores = torch.where(rollout.ended, scores, scores - config.missing_eos_penalty)
    kl = torch.where(mask, F.kl_penalty(logprobs, ref_logprobs, config.kl_estimator), 0.0)
    # With kl_placement "loss" the KL is a loss term instead (recomputed in every minibatch).
    rewards = -kl_coef * kl if config.kl_placement == "reward" else torch.zeros_like(kl)
    rows = torch.arange(len(scores), device=scores.device)
    # The score is earned by the whole response, so it lands on its last real token.
    rewards[rows, last_token_index(mask)] += scores
    if rollout.turn_rewards is not None:  # an environment's per-turn rewards, on each turn's last token
        rewards = rewards + torch.where(mask, rollout.turn_rewards, 0.0)
    values = torch.where(mask, values, 0.0)
    advantages, returns = estimate_advantages(rewards, values, mask, config, reduce)
    return Experience(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        position_ids=rollout.position_ids,
        response_ids=rollout.response_ids,
        response_mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        scores=scores,
        kl=kl,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
        is_weights=is_weights,
    )


def estimate_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, config: PPOConfig, reduce: F.Reduce | None = None
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), both (B, R) and 0 on padding, by ``config.advantage_estimator``.

    Whitening and REINFORCE++'s normalisation use every rank's tokens when ``reduce`` is given.
    """
    estimator = config.advantage_estimator
    if estimator == "gae":
        if config.whiten_rewards:
            rewards = F.masked_whiten(rewards, mask, shift_mean=False, reduce=reduce)
        advantages, returns = F.gae(rewards, values, mask, config.gamma, config.gae_lambda)
        if config.whiten_advantages:
            advantages = F.masked_whiten(advantages, mask, reduce=reduce)
        return advantages, returns
    if estimator == "reinforce_pp":
        # REINFORCE++: token-level reward-to-go (KL included), normalised over the global batch.
        returns = F.discounted_returns(rewards, mask, config.gamma)
        return F.masked_whiten(returns, mask, reduce=reduce), returns
    # grpo / rloo: one return per sequence (score plus its KL part), compared within its group.
    # A dropped sample's mask is empty: it leaves its group's baseline instead of counting as 0.
    sequence_return = rewards.sum(dim=1)
    valid = mask.any(dim=1)
    scale = group_scale(sequence_return, valid, config, reduce)
    advantage = F.group_advantages(
        sequence_return, config.num_generations, estimator, valid=valid, scale=scale
    )
    zero = torch.zeros_like(rewards)
    return torch.where(mask, advantage[:, None], zero), torch.where(mask, sequence_return[:, None], zero)


def group_scale(
    returns: Tensor, valid: Tensor, config: PPOConfig, reduce: F.Reduce | None = None
) -> Tensor | None:
    """The divisor of ``grpo``'s advantages other than each group's own std (``scale_rewards``):
    the std of every rank's kept returns plus 1e-6 (``batch``), or 1 (``none``); ``None``: the
    group's (``group``, and ``rloo``, which divides by nothing)."""
    if config.advantage_estimator != "grpo" or config.scale_rewards == "group":
        return None
    if config.scale_rewards == "none":
        return torch.ones((), dtype=returns.dtype, device=returns.device)
    return F.masked_var(returns, valid, unbiased=True, reduce=reduce).sqrt() + 1e-6
