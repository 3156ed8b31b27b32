"""Do the samples come from the policy the run claims sampled them? A likelihood-ratio test.

The plateau cannot see an engine that samples with weights one update older than the run claims:
a lagged on-policy gradient has the same fixed point (``docs/selfcheck.md``). The responses
themselves can. At iteration ``t`` let ``p`` be the exact distribution of the policy the run says
sampled the batch (``ppo.max_staleness`` 0: the weights at the iteration's start; else the version
it records) and ``q`` that of the policy one update earlier. For the batch's responses ``y_i`` (row
``i``'s prompt ``x_i``),

    S_t = sum_i [log p(y_i | x_i) - log q(y_i | x_i)]

has, if each ``y_i`` was drawn from ``p(. | x_i)``, exactly the mean ``sum_i KL(p || q)(x_i)`` and
the variance ``sum_i Var_p[log p - log q](x_i)``. Drawn from ``q`` instead, its mean is
``-sum_i KL(q || p)(x_i)``: lower by about twice the variance's own size where ``p`` and ``q`` are
close, the most powerful test of one against the other (Neyman-Pearson). Summed over iterations and
standardised, ``z = (sum S - sum mean) / sqrt(sum variance)``: each iteration's responses are fresh
draws given the run so far, so ``sum (S - mean)`` is a martingale and ``z`` tends to a standard
normal under the claim (the martingale central limit theorem). The check fails when
``z < -Z_SAMPLING``: one-sided, as sampling from the older policy pushes ``z`` down.

Pure math on tensors: the callback that collects the distributions and the responses is
:mod:`lightning_ppo.selfcheck.recorder`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# One-sided: a correct run falls below -4 by chance with probability 3.2e-5 (the normal's tail).
Z_SAMPLING = 4.0
# two turns: an episode's likelihood needs the environment's turns listed too
NOT_CHECKED = f"  {'sampling':<17} not checked in two turns"
TERMS = ("statistic", "mean", "variance", "rows", "unlisted")  # the columns of :func:`ratio_terms`


def ratio_terms(claimed: Tensor, other: Tensor, prompts: Tensor, responses: Tensor) -> Tensor:
    """(5,) float64: ``S``, its mean and its variance under ``claimed``, the rows counted, and the rows
    that are not a listed response (index -1: counted, left out of the sums).

    Args:
        claimed: (P, N) log-probs of every response of each prompt under the policy the run claims.
        other: (P, N) the same under the policy one update earlier.
        prompts: (B,) each row's prompt (an index into P), -1 where the prompt is not listed.
        responses: (B,) each row's response (an index into N), -1 where it is not listed.
    """
    claimed, other = claimed.double(), other.double()
    listed = (prompts >= 0) & (responses >= 0)
    prob = claimed.exp()
    # 0 x (anything) is 0 where the claimed policy cannot give a response
    log_ratio = torch.where(prob > 0, claimed - other, 0.0)
    kl = (prob * log_ratio).sum(dim=1)  # (P,) KL(claimed || other)
    variance = (prob * (log_ratio - kl[:, None]).square()).sum(dim=1)
    x, y = prompts[listed], responses[listed]
    statistic = (claimed[x, y] - other[x, y]).sum()
    rows = torch.tensor(float(len(prompts)), dtype=torch.float64)
    unlisted = (~listed).sum().double()
    return torch.stack([statistic, kl[x].sum(), variance[x].sum(), rows, unlisted])


@dataclass(frozen=True)
class SamplingCheck:
    """The summed :func:`ratio_terms` of a run: PASS unless ``z < -z_crit`` or a sampled response is
    not one the policy can give.

    Attributes:
        statistic: ``sum_t S_t``.
        mean: Its exact mean had every response been drawn from the claimed policy.
        variance: Its exact variance under the same.
        rows: Responses checked, every rank's.
        unlisted: Responses sampled that are none of the listed ones (a token sampling may not draw,
            or longer than ``max_new_tokens``): the claimed policy cannot have sampled them.
        z_crit: The threshold.
    """

    statistic: float
    mean: float
    variance: float
    rows: int
    unlisted: int = 0
    z_crit: float = Z_SAMPLING

    @classmethod
    def of(cls, terms: Tensor, z_crit: float = Z_SAMPLING) -> SamplingCheck:
        """From the ``(iterations, 5)`` rows of :func:`ratio_terms`, summed."""
        total = terms.double().sum(dim=0).tolist()
        statistic, mean, variance, rows, unlisted = total
        return cls(statistic, mean, variance, int(round(rows)), int(round(unlisted)), z_crit)

    @property
    def z(self) -> float:
        """``(statistic - mean) / sqrt(variance)``; 0 when the policy never moved (nothing to tell)."""
        if self.variance <= 0:
            return 0.0
        return (self.statistic - self.mean) / math.sqrt(self.variance)

    @property
    def passed(self) -> bool:
        return self.unlisted == 0 and math.isfinite(self.z) and self.z >= -self.z_crit

    def line(self) -> str:
        verdict = "ok" if self.passed else "OUT OF BAND"
        unlisted = f", {self.unlisted} responses the policy cannot give" if self.unlisted else ""
        return (
            f"  {'sampling':<17} z {self.z:+.2f} over {self.rows} responses{unlisted}: log-likelihood ratio, "
            f"the claimed policy vs one update older, standardised (below {-self.z_crit:g}: sampled by an "
            f"older one)  {verdict}"
        )
