"""The reward-scale warning: scores that vary by less than kl_coef cannot move the policy."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from lightning_ppo.watch.metrics import reward_drowned
from tests.helpers import fit_warnings

MESSAGE = "so the score will stay flat"


def test_reward_drowned_compares_the_spread_with_kl_coef():
    assert reward_drowned(0.006, 0.05)  # a 0-1 reward shrunk 30-fold, default kl_coef
    assert not reward_drowned(0.2, 0.05)  # the same reward unshrunk
    assert not reward_drowned(1.0, 0.05)  # normalised scores
    assert not reward_drowned(0.0, 0.05)  # nothing varies yet (a sparse reward): not a scale problem


def _fit(policy, weight: float, **ppo) -> list[str]:
    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        reward_weights=[weight],
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1, kl_coef=0.05, **ppo),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = DigitsDataModule(num_prompts=64, num_digits=3, batch_size=8, max_prompt_length=8)
    return [message for message in fit_warnings(module, data, iterations=6) if MESSAGE in message]


@pytest.mark.parametrize(
    ("weight", "ppo", "warned"),
    [(0.03, {}, 1), (1.0, {}, 0), (0.03, {"score_norm": True}, 0)],
    ids=["shrunk reward", "0-1 reward", "shrunk reward, score_norm"],
)
def test_a_shrunk_reward_warns_once(weight, ppo, warned, tiny_digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(_fit(tiny_digits, weight, **ppo)) == warned
