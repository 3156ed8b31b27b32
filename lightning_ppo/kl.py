"""KL-penalty coefficient controllers: fixed, or adaptive toward a target KL (Ziegler et al., 2019)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_episodes: int) -> None:
        """A fixed coefficient ignores the measured KL."""

    @property
    def pinned(self) -> bool:
        return False


@dataclass
class AdaptiveKLController:
    """Proportional controller that moves the coefficient so the measured KL approaches ``target``.

    ``value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_episodes / horizon``: too much KL raises
    the coefficient, too little lowers it, by at most 20 % of ``n_episodes / horizon`` per update
    (the proportional error is clipped as in Ziegler et al.). The value stays within
    ``[min_value, max_value]``: a policy that runs away from the reference faster than any penalty
    can pull it back (a learning rate far too large) otherwise drove it without bound (0.05 -> 690
    in one user's run) while the answers collapsed.
    """

    value: float
    target: float
    horizon: float
    min_value: float = 0.0
    max_value: float = float("inf")

    def update(self, current_kl: float, n_episodes: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_episodes / self.horizon
        self.value = min(max(self.value, self.min_value), self.max_value)

    @property
    def pinned(self) -> bool:
        """Whether the coefficient sits at one of its bounds (it can no longer steer that way)."""
        return self.value <= self.min_value or self.value >= self.max_value


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kl_coef: float,
    kl_target: float | None,
    kl_horizon: float,
    kl_coef_min: float = 0.0,
    kl_coef_max: float = float("inf"),
) -> KLController:
    """The adaptive controller (bounded by ``[kl_coef_min, kl_coef_max]``) when a target is set,
    otherwise a fixed coefficient."""
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon, kl_coef_min, kl_coef_max)
