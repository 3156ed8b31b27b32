"""KL-penalty coefficient controllers: fixed, or adaptive toward a target KL (Ziegler et al., 2019)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_episodes: int) -> None:
        """A fixed coefficient ignores the measured KL."""


@dataclass
class AdaptiveKLController:
    """Proportional controller that moves the coefficient so the measured KL approaches ``target``.

    ``value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_episodes / horizon``: too much KL raises
    the coefficient, too little lowers it, by at most 20 % of ``n_episodes / horizon`` per update.
    """

    value: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_episodes: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_episodes / self.horizon


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(kl_coef: float, kl_target: float | None, kl_horizon: float) -> KLController:
    """The adaptive controller when a target is set, otherwise a fixed coefficient."""
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
