"""The KL controllers with hand numbers: Ziegler's rule, no wind-up, look-ahead, bounds, resume."""

from __future__ import annotations

import math

import pytest

from lightning_ppo.ppo.kl import AdaptiveKLController, FixedKLController


def test_too_much_kl_raises_the_slow_part_by_ziegler_and_the_coefficient_at_once():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(current_kl=5.0, n_episodes=10)
    assert ctl.integral == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error 4 clipped to 0.2
    assert ctl.value == pytest.approx(0.102 * math.e)  # log(5) clipped to 1
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1


def test_the_kl_of_zero_at_the_start_does_not_wind_the_coefficient_down():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    for _ in range(5):  # the policy starts as the reference: KL 0
        ctl.update(current_kl=0.0, n_episodes=10)
    assert ctl.integral == 0.1 and not ctl.reached
    assert ctl.value == pytest.approx(0.1 / math.e)  # only the proportional part eases off


def test_a_kl_climbing_toward_the_target_raises_the_coefficient_before_it_passes():
    ctl = AdaptiveKLController(0.1, target=4.0, horizon=64)
    ctl.update(current_kl=0.0, n_episodes=64)
    ctl.update(current_kl=1.0, n_episodes=64)  # trend 0.3: expected 1 + 10 x 0.3 = 4, the target
    assert ctl.reached and ctl.integral == 0.1 and ctl.value == pytest.approx(0.1)
    ctl.update(current_kl=2.0, n_episodes=64)  # trend 0.51: expected 7.1, still below target now
    assert ctl.integral == pytest.approx(0.12)
    assert ctl.value == pytest.approx(0.12 * 7.1 / 4.0)


def test_the_coefficient_stays_within_its_bounds():
    up = AdaptiveKLController(0.05, target=4.0, horizon=64, min_value=0.001, max_value=0.08)
    up.update(current_kl=60.0, n_episodes=64)  # 0.06 x e = 0.163, capped
    assert up.value == 0.08 and up.pinned
    for _ in range(3):  # the slow part: 0.06, 0.072, 0.0864 -> capped too
        up.update(current_kl=60.0, n_episodes=64)
    assert up.integral == 0.08
    down = AdaptiveKLController(0.0012, target=4.0, horizon=64, min_value=0.001, max_value=10.0)
    down.update(current_kl=0.0, n_episodes=64)  # 0.0012 / e = 0.00044, raised to the bound
    assert down.value == 0.001 and down.pinned


def test_a_resumed_controller_steers_as_the_uninterrupted_one():
    kls = [0.0, 1.5, 3.0, 5.5, 6.0, 4.5, 3.9]
    full = AdaptiveKLController(0.05, target=4.0, horizon=256)
    for kl in kls:
        full.update(kl, 64)
    first = AdaptiveKLController(0.05, target=4.0, horizon=256)
    for kl in kls[:4]:
        first.update(kl, 64)
    resumed = AdaptiveKLController(0.05, target=4.0, horizon=256)
    resumed.load_state_dict(first.state_dict())
    for kl in kls[4:]:
        resumed.update(kl, 64)
    assert resumed.state_dict() == full.state_dict()
