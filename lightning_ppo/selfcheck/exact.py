"""The exact optimum of the KL-regularised objective over a set of responses small enough to list.

For each prompt x the objective ``E_pi[r(x, y)] - beta KL(pi(.|x) || pi_ref(.|x))`` is maximised by
``pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x)`` (Gibbs' variational principle): for any pi,
``J(pi) = beta log Z(x) - beta KL(pi || pi*)``. Given every response's reference log-prob and reward,
pi*'s expected reward and its KL from the reference follow by summation, in float64. The same
identity says how far a policy is from the optimum in objective units: ``beta KL(pi || pi*)``.

Pure math on tensors: nothing of the package, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class TiltedOptimum:
    """The optimum at one ``beta``, as the run reports it: per response, averaged over the prompts.

    Attributes:
        beta: The KL coefficient.
        reward: ``E_x E_{pi*}[r]``, what ``objective/scores`` should settle at.
        kl: ``E_x KL(pi*(.|x) || pi_ref(.|x))`` in nats per response, what ``objective/kl`` should
            settle at (a response's KL is the sum of its tokens' log-ratios).
        reward_std: The std of one response's reward around its prompt's mean, ``y ~ pi*(.|x)``,
            pooled over the prompts by their weights: the sampling noise of ``objective/scores`` when
            each batch holds every prompt in its proportion (a batch mean of n responses then varies
            by ``reward_std / sqrt(n)``).
        kl_std: The same of one response's log-ratio ``log pi*/pi_ref = r / beta - log Z(x)``: the
            sampling noise of ``objective/kl``.
        reference_reward: ``E_x E_{pi_ref}[r]``, where training starts.
        greedy_reward: ``E_x max_y r``, where ``beta -> 0`` (or a KL term that pushes away) ends.
        objective: ``beta E_x log Z(x)``, the objective's maximum.
        objective_std: The std of one response's ``r - beta log pi*/pi_ref`` within its prompt: 0
            in one turn (it is ``beta log Z(x)`` for every response); in episodes, what the
            environment's randomness leaves.
    """

    beta: float
    reward: float
    kl: float
    reward_std: float
    kl_std: float
    reference_reward: float
    greedy_reward: float
    objective: float
    objective_std: float = 0.0


def tilted_optimum(
    ref_logprobs: Tensor, rewards: Tensor, beta: float, prompt_weights: Tensor | None = None
) -> TiltedOptimum:
    """The optimum of ``E[r] - beta KL`` over responses whose reference log-probs are all listed.

    Args:
        ref_logprobs: (P, N) ``log pi_ref(y|x)`` of every response y of each prompt x; each row sums to
            probability 1 (``-inf`` for a response a prompt cannot have).
        rewards: (P, N) ``r(x, y)``.
        beta: The KL coefficient (> 0).
        prompt_weights: (P,) how often each prompt is drawn (normalised here); default uniform.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    ref, r = ref_logprobs.double(), rewards.double()
    weights = torch.ones(len(ref), dtype=torch.float64) if prompt_weights is None else prompt_weights.double()
    weights = weights / weights.sum()
    log_z = torch.logsumexp(ref + r / beta, dim=1)  # (P,)
    log_ratio = r / beta - log_z[:, None]  # log pi*/pi_ref
    optimum = (ref + log_ratio).exp()  # (P, N) pi*, each row sums to 1
    reference = ref.exp()
    reward = _mean(optimum, r, weights)
    kl = _mean(optimum, log_ratio, weights)
    return TiltedOptimum(
        beta=beta,
        reward=reward,
        kl=kl,
        reward_std=_pooled_std(optimum, r, weights),
        kl_std=_pooled_std(optimum, log_ratio, weights),
        reference_reward=_mean(reference, r, weights),
        greedy_reward=float((weights * r.masked_fill(reference == 0, -torch.inf).amax(dim=1)).sum()),
        objective=float(beta * (weights * log_z).sum()),
    )


def rated_optimum(ref_logprobs: Tensor, rater_rewards: Tensor, beta: float) -> TiltedOptimum:
    """The optimum when raters the policy cannot tell apart score the rows in turn, as many each.

    The policy answers every rater alike, so its objective is its reference tilted by the raters'
    mean reward; the sampling noise of ``objective/scores`` is each rater's spread, pooled (a batch
    holds as many rows of each), and one response's ``r - beta log pi*/pi_ref`` varies with who
    rated it (``objective_std``).

    Args:
        ref_logprobs: (P, N) as :func:`tilted_optimum` takes.
        rater_rewards: (C, P, N) each rater's reward of every response of each prompt.
        beta: The KL coefficient (> 0).
    """
    mean = rater_rewards.double().mean(dim=0)
    optimum = tilted_optimum(ref_logprobs, mean, beta)
    log_optimum = ref_logprobs.double() + mean / beta
    probs = (log_optimum - torch.logsumexp(log_optimum, dim=1, keepdim=True)).exp()
    weights = torch.full((len(mean),), 1.0 / len(mean), dtype=torch.float64)
    rewards, disagreements = rater_rewards.double(), rater_rewards.double() - mean
    return replace(
        optimum,
        reward_std=_pooled_over_raters(probs, rewards, weights),
        objective_std=_pooled_over_raters(probs, disagreements, weights),
    )


def _pooled_over_raters(probs: Tensor, values: Tensor, weights: Tensor) -> float:
    """``sqrt(E_c E_x Var_{probs(.|x)}[values_c])``: each rater's spread within each prompt, pooled."""
    return (sum(_pooled_std(probs, rated, weights) ** 2 for rated in values) / len(values)) ** 0.5


def _mean(probs: Tensor, values: Tensor, weights: Tensor) -> float:
    """``E_x E_{probs(.|x)}[values]``; 0 x (anything) is 0 where a response has probability 0."""
    return float((weights * torch.where(probs > 0, probs * values, 0.0).sum(dim=1)).sum())


def _pooled_std(probs: Tensor, values: Tensor, weights: Tensor) -> float:
    """``sqrt(E_x Var_{probs(.|x)}[values])``: the spread within each prompt, pooled."""
    means = torch.where(probs > 0, probs * values, 0.0).sum(dim=1, keepdim=True)
    return _mean(probs, (values - means).square(), weights) ** 0.5


def kl_to_optimum(policy_logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """(P,) ``KL(pi(.|x) || pi*(.|x))`` of a policy whose log-probs of every response are listed:
    by the identity above, the objective the policy leaves on the table is ``beta`` times it."""
    pi, ref, r = policy_logprobs.double(), ref_logprobs.double(), rewards.double()
    log_optimum = ref + r / beta
    log_optimum = log_optimum - torch.logsumexp(log_optimum, dim=1, keepdim=True)
    return torch.where(pi.exp() > 0, pi.exp() * (pi - log_optimum), 0.0).sum(dim=1)
