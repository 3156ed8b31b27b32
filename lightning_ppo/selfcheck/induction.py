"""The exact optimum of a two-turn episode with an environment between the turns, by backward induction.

The objective is the episode's reward (both turns') less ``beta`` times the KL of the policy's own
tokens (both replies; the environment's are context). Its optimum is the soft Bellman one: after a
first reply ``y1`` and the environment's observation ``o``,

    V2(y1, o) = beta log sum_y2 pi_ref(y2 | y1, o) exp(r2(o, y2) / beta)
    Q1(y1)    = r1(y1) + sum_o P(o | y1) V2(y1, o)
    V1        = beta log sum_y1 pi_ref(y1) exp(Q1(y1) / beta)

and ``pi*`` tilts each turn's reference by ``exp(Q / beta)``: ``pi*(y1) = pi_ref(y1) exp((Q1 - V1) /
beta)``, ``pi*(y2 | y1, o) = pi_ref(y2 | ...) exp((r2 - V2) / beta)``. ``V1`` is the objective's
maximum; as in one turn, any policy falls short of it by ``beta KL(pi || pi*)`` over whole episodes.
Pure math on float64 tensors, per prompt (a leading dimension P).

Shapes: N replies per turn, O observations. ``ref1`` (P, N), ``r1`` (P, N), ``transition`` (P, N, O),
``ref2`` (P, N, O, N), ``r2`` (P, N, O, N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ppo.selfcheck.exact import TiltedOptimum


@dataclass(frozen=True)
class TwoTurns:
    """Every episode of each prompt: the turns' reference log-probs, rewards and the transitions."""

    ref1: Tensor
    r1: Tensor
    transition: Tensor
    ref2: Tensor
    r2: Tensor

    def soft_policy(self, beta: float) -> tuple[Tensor, Tensor, Tensor]:
        """``(log pi*1 (P, N), log pi*2 (P, N, O, N), V1 (P,))`` at ``beta``."""
        v2 = beta * torch.logsumexp(self.ref2 + self.r2 / beta, dim=-1)  # (P, N, O)
        q1 = self.r1 + (self.transition * v2).sum(-1)
        v1 = beta * torch.logsumexp(self.ref1 + q1 / beta, dim=-1)  # (P,)
        log1 = self.ref1 + (q1 - v1[:, None]) / beta
        log2 = self.ref2 + (self.r2 - v2[..., None]) / beta
        return log1, log2, v1

    def episodes(self, log1: Tensor, log2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Under the policy ``(log1, log2)``: each episode's probability (P, N, O, N), its reward and
        its log-ratio to the reference over both replies."""
        prob = log1.exp()[..., None, None] * self.transition[..., None] * log2.exp()
        reward = self.r1[..., None, None] + self.r2
        log_ratio = (log1 - self.ref1)[..., None, None] + (log2 - self.ref2)
        return prob, reward, log_ratio

    def optimum(self, beta: float) -> TiltedOptimum:
        """The optimum at ``beta``, in the run's units, the prompts weighed equally."""
        log1, log2, v1 = self.soft_policy(beta)
        prob, reward, log_ratio = self.episodes(log1, log2)
        objective = reward - beta * log_ratio  # varies with the observation's luck only
        ref_prob = self.episodes(self.ref1, self.ref2)[0]
        return TiltedOptimum(
            beta=beta,
            reward=_mean(prob, reward),
            kl=_mean(prob, log_ratio),
            reward_std=_pooled_std(prob, reward),
            kl_std=_pooled_std(prob, log_ratio),
            reference_reward=_mean(ref_prob, reward),
            greedy_reward=float(self.greedy().mean()),
            objective=float(v1.mean()),
            objective_std=_pooled_std(prob, objective),
        )

    def greedy(self) -> Tensor:
        """(P,) the most expected reward any policy earns (the hard Bellman values)."""
        g2 = self.r2.masked_fill(self.ref2 == -torch.inf, -torch.inf).amax(-1)
        return (
            (self.r1 + (self.transition * g2).sum(-1))
            .masked_fill(self.ref1 == -torch.inf, -torch.inf)
            .amax(-1)
        )

    def distance(self, log1: Tensor, log2: Tensor, beta: float) -> float:
        """``E_x KL(pi || pi*)`` over whole episodes of the policy ``(log1, log2)``, in nats."""
        opt1, opt2, _ = self.soft_policy(beta)
        p1, p2 = log1.exp(), log2.exp()
        first = torch.where(p1 > 0, p1 * (log1 - opt1), 0.0).sum(-1)
        second = torch.where(p2 > 0, p2 * (log2 - opt2), 0.0).sum(-1)  # (P, N, O)
        return float((first + (p1[..., None] * self.transition * second).sum((-1, -2))).mean())


def _mean(prob: Tensor, values: Tensor) -> float:
    per_prompt = torch.where(prob > 0, prob * values, 0.0).flatten(1).sum(1)
    return float(per_prompt.mean())


def _pooled_std(prob: Tensor, values: Tensor) -> float:
    """``sqrt(E_x Var(values | x))``: the spread within each prompt, pooled over the prompts."""
    flat_p, flat_v = prob.flatten(1), values.flatten(1)
    mean = torch.where(flat_p > 0, flat_p * flat_v, 0.0).sum(1, keepdim=True)
    var = torch.where(flat_p > 0, flat_p * (flat_v - mean).square(), 0.0).sum(1)
    return float(var.mean()) ** 0.5
