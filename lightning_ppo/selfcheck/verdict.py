"""PASS or FAIL: where the run's own logged curves settled, against the exact optimum.

The run logs, every iteration, the mean over that iteration's responses (every rank's) of the
reward (``objective/scores``) and of each response's KL estimate, the sum of its tokens'
``log pi - log pi_ref`` (``objective/kl``, nats per response); their difference
``objective/scores - beta objective/kl`` estimates the objective ``J``. The plateau is the mean of
each over the last ``window`` iterations, ``n`` responses in all. It passes when all three gaps lie
within their bands (``docs/selfcheck.md`` derives them; ``eps`` nats of ``KL(pi || pi*)`` is how
far from the optimum the optimiser may leave the policy, on average over the plateau):

* reward: ``|gap| <= Z sigma_r / sqrt(n) + sigma_r sqrt(2 eps)``
* KL: ``|gap| <= Z sigma_k / sqrt(n) + eps + sigma_r sqrt(2 eps) / beta``
* objective: ``-beta eps - Z s_J / sqrt(n) <= gap <= Z s_J / sqrt(n)``,
  ``s_J = sqrt(2 eps beta^2 + sigma_J^2)``

``sigma_r`` and ``sigma_k`` are one response's std of the reward and of ``log pi*/pi_ref`` under the
optimum (exact), so the first terms are ``Z`` standard errors of sampling noise; the second terms
are the most a policy ``eps`` nats from the optimum moves each mean (to second order). The objective
is exact: ``J(pi) = J* - beta KL(pi || pi*)``, never above ``J*``, and one response's
``r - beta log pi/pi_ref`` varies by only ``beta sqrt(2 KL(pi || pi*))`` (plus, in episodes,
``sigma_J``: what the environment's randomness moves it by under the optimum, exact); a run whose
logged objective exceeds the maximum measured its KL wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lightning_ppo.selfcheck.exact import TiltedOptimum
from lightning_ppo.watch.plot import read_metrics

Z = 4.0  # standard errors of sampling noise: a correct run fails by chance about once in 16 000
# Nats of KL(pi || pi*) the optimiser may leave on average over the plateau (beta x it of the
# objective). Measured on correct setups (benchmarks/selfcheck_calibration.py): 0.004-0.015; 0.025-0.029
# with a shared critic (its value loss also moves the policy's weights), LoRA or temperature 0.7;
# 0.030-0.040 in two turns.
EPSILON = 0.05
SCORES, KL, EPISODE = "objective/scores", "objective/kl", "episode"
OBJECTIVE = "objective"  # objective/scores - beta objective/kl, per iteration


@dataclass(frozen=True)
class Check:
    """One logged quantity against its exact value: it passes when ``low <= reached - exact <= high``.

    Attributes:
        name: The logged metric.
        exact: Its value at the optimum.
        reached: Its mean over the plateau.
        spread: The std of its per-iteration values over the plateau.
        low, high: The gaps sampling noise and the allowance explain (``low`` < 0 < ``high``).
    """

    name: str
    exact: float
    reached: float
    spread: float
    low: float
    high: float

    @property
    def gap(self) -> float:
        return self.reached - self.exact

    @property
    def band(self) -> float:
        """The band's half-width on the side of the gap."""
        return self.high if self.gap >= 0 else -self.low

    @property
    def passed(self) -> bool:
        return math.isfinite(self.reached) and self.low <= self.gap <= self.high

    def line(self) -> str:
        verdict = "ok" if self.passed else "OUT OF BAND"
        band = f"+-{self.high:.4f}" if self.high == -self.low else f"[{self.low:+.4f}, {self.high:+.4f}]"
        return (
            f"  {self.name:<17} exact {self.exact:8.4f}  reached {self.reached:8.4f} "
            f"(spread {self.spread:.4f})  gap {self.gap:+.4f}  band {band}  {verdict}"
        )


@dataclass(frozen=True)
class Plateau:
    """The last ``iterations`` logged iterations: their scores and KLs, and the responses behind them."""

    responses: int
    scores: tuple[float, ...]
    kl: tuple[float, ...]

    @property
    def iterations(self) -> int:
        return len(self.scores)

    @classmethod
    def read(cls, metrics: Path, window: int) -> Plateau:
        _, series = read_metrics(metrics)
        missing = [key for key in (SCORES, KL, EPISODE) if key not in series]
        if missing:
            raise ValueError(f"{metrics} has no {missing} column: the run logged no PPO iteration")
        episodes = series[EPISODE][1]
        # ``episode`` counts every rank's responses so far: the window's are its last value less the
        # one before the window
        before = episodes[-window - 1] if len(episodes) > window else 0.0
        return cls(
            responses=int(round(episodes[-1] - before)),
            scores=tuple(series[SCORES][1][-window:]),
            kl=tuple(series[KL][1][-window:]),
        )

    def objective(self, beta: float) -> tuple[float, ...]:
        return tuple(s - beta * k for s, k in zip(self.scores, self.kl, strict=True))


def _mean(values: tuple[float, ...]) -> float:
    return sum(values) / len(values) if values else math.nan


def _spread(values: tuple[float, ...]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))


def judge(
    optimum: TiltedOptimum, plateau: Plateau, epsilon: float = EPSILON, z: float = Z
) -> tuple[Check, Check, Check]:
    """The reward's, the KL's and the objective's :class:`Check` of a plateau against the optimum."""
    root_n = math.sqrt(max(plateau.responses, 1))
    beta = optimum.beta
    shift = optimum.reward_std * math.sqrt(2 * epsilon)  # the most a policy eps nats off moves E[r]
    reward = z * optimum.reward_std / root_n + shift
    kl = z * optimum.kl_std / root_n + epsilon + shift / beta
    # one response's objective varies by beta sqrt(2 eps) near the optimum, beside what the
    # environment's randomness adds in episodes (0 in one turn)
    noise = z * math.sqrt(2 * epsilon * beta**2 + optimum.objective_std**2) / root_n
    objective = plateau.objective(beta)
    return (
        Check(SCORES, optimum.reward, _mean(plateau.scores), _spread(plateau.scores), -reward, reward),
        Check(KL, optimum.kl, _mean(plateau.kl), _spread(plateau.kl), -kl, kl),
        Check(
            OBJECTIVE, optimum.objective, _mean(objective), _spread(objective), -beta * epsilon - noise, noise
        ),
    )
