"""KL-penalty coefficient controllers: fixed, or adaptive toward a target KL.

The adaptive controller starts from Ziegler et al. (2019) and adds what a run from scratch needs.
Measured on the small-spread task of ``benchmarks/learning.py`` (score_norm, kl_target 4,
kl_horizon 256, 300 iterations), Ziegler's rule alone let the 10-iteration mean KL overshoot to
10.4 and then pulled the policy back, erasing the gain (best score 0.86, last 0.65): at the start
the KL is 0 by construction, so the coefficient was lowered while the policy was still on its
way (integral wind-up), and once the KL passed the target it kept climbing for ~30 iterations
while the coefficient crept up by at most 5 % per iteration. Three changes, each measured there:

* **no wind-up**: the slow part of the coefficient is not lowered until the KL has reached the
  target once;
* **look-ahead**: the error is taken on the KL expected ``lookahead`` iterations ahead (the
  current KL plus its smoothed per-iteration change), so the coefficient rises while the KL
  climbs toward the target, not after it has passed it;
* **a proportional part**: the coefficient used is the slow (integral) part times
  ``exp(clip(log(expected / target), -1, 1))``, which answers a KL twice the target at once.

Together: maximum 10-iteration mean KL 5.5 against the target 4, and within +-50 % of it on every
iteration after the first 10 % (76 % with Ziegler's rule), with no pull-back (best 0.653 = last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The default horizon, in iterations: each iteration's episodes are a quarter of it.
HORIZON_ITERATIONS = 4


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_episodes: int) -> None:
        """A fixed coefficient ignores the measured KL."""

    @property
    def pinned(self) -> bool:
        return False

    def state_dict(self) -> dict[str, float | bool | None]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float | bool | None]) -> None:
        self.value = float(state["value"])  # type: ignore[arg-type]


@dataclass
class AdaptiveKLController:
    """Moves the coefficient so the measured KL per response approaches ``target``.

    Each update (one PPO iteration of ``n_episodes`` responses, every rank's):

    * ``expected = max(kl + lookahead * trend, 0)``, ``trend`` the per-iteration change of the KL
      smoothed by an exponential moving average (weight ``trend_weight`` on the newest change);
    * the slow part: ``integral *= 1 + clip(expected / target - 1, -0.2, 0.2) * n_episodes /
      horizon`` (Ziegler et al.'s rule, proportional error clipped), not lowered before the KL
      first reached the target;
    * ``value = integral * exp(clip(log(expected / target), -1, 1))``.

    ``value`` and ``integral`` stay within ``[min_value, max_value]``: a policy that runs away from
    the reference faster than any penalty can pull it back (a learning rate far too large)
    otherwise drove the coefficient without bound (0.05 -> 690 in one user's run).

    ``horizon`` sets how fast the slow part follows: by a factor of at most
    ``1 + 0.2 * n_episodes / horizon`` per iteration. ``None`` (the default) is
    :data:`HORIZON_ITERATIONS` iterations' episodes: at most 5 % per iteration, 10x in 47. Slower
    let the KL overshoot (horizon 549 at 64 episodes per iteration: 10-iteration mean KL up to 7.3
    against a target of 4); faster swings (64: the KL went from 1.4 to 7.4 and back).
    """

    value: float
    target: float
    horizon: float | None
    min_value: float = 0.0
    max_value: float = float("inf")
    lookahead: float = 10.0
    trend_weight: float = 0.3

    def __post_init__(self) -> None:
        self.integral = self.value
        self.last_kl: float | None = None
        self.trend = 0.0
        self.reached = False

    def update(self, current_kl: float, n_episodes: int) -> None:
        if self.last_kl is not None:
            change = current_kl - self.last_kl
            self.trend = (1 - self.trend_weight) * self.trend + self.trend_weight * change
        self.last_kl = current_kl
        expected = max(current_kl + self.lookahead * self.trend, 0.0)
        self.reached = self.reached or expected >= self.target
        error = min(max(expected / self.target - 1.0, -0.2), 0.2)
        if self.reached or error > 0:
            horizon = self.horizon or HORIZON_ITERATIONS * n_episodes
            self.integral = self._bounded(self.integral * (1.0 + error * n_episodes / horizon))
        log_ratio = math.log(max(expected, 1e-8) / self.target)
        self.value = self._bounded(self.integral * math.exp(min(max(log_ratio, -1.0), 1.0)))

    def _bounded(self, value: float) -> float:
        return min(max(value, self.min_value), self.max_value)

    @property
    def pinned(self) -> bool:
        """Whether the coefficient sits at one of its bounds (it can no longer steer that way)."""
        return self.value <= self.min_value or self.value >= self.max_value

    def state_dict(self) -> dict[str, float | bool | None]:
        """What a resumed run needs to steer as the uninterrupted one does."""
        keys = ("value", "integral", "last_kl", "trend", "reached")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, float | bool | None]) -> None:
        """Also takes ``{"value": v}`` alone (older checkpoints; a run that had a fixed coefficient)."""
        self.integral = state["value"]
        for key, saved in state.items():
            setattr(self, key, saved)


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kl_coef: float,
    kl_target: float | None,
    kl_horizon: float | None,
    kl_coef_min: float = 0.0,
    kl_coef_max: float = float("inf"),
) -> KLController:
    """The adaptive controller (bounded by ``[kl_coef_min, kl_coef_max]``) when a target is set,
    otherwise a fixed coefficient."""
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon, kl_coef_min, kl_coef_max)
