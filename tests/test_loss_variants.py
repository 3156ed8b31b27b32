"""The loss variants users of TRL's GRPO and verl know, against hand numbers: loss aggregation
(DAPO's token mean, GRPO's sequence mean, Dr. GRPO's constant), clip-higher, scale_rewards."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.experience import estimate_advantages
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_each_loss_aggregation_against_hand_numbers():
    assert F.Aggregation("token_mean")(PER_TOKEN, MASK).item() == pytest.approx(10 / 4)
    assert F.Aggregation("sequence_mean")(PER_TOKEN, MASK).item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert F.Aggregation("constant", 5)(PER_TOKEN, MASK).item() == pytest.approx(10 / (2 * 5))
    empty_row = torch.tensor([[True, True, True], [False, False, False]])  # a dropped response
    assert F.Aggregation("sequence_mean")(PER_TOKEN, empty_row).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="loss aggregation must be one of"):
        F.Aggregation("constant")(PER_TOKEN, MASK)


def test_clip_higher_widens_only_the_upper_side():
    logprobs = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    symmetric = F.policy_loss(logprobs, old, advantages, mask, 0.2)
    higher = F.policy_loss(logprobs, old, advantages, mask, (0.2, 0.28))
    # token 0: max(-1.5, -1.2) = -1.2, with clip-higher max(-1.5, -1.28) = -1.28; token 1: max(0.5, 0.8)
    assert symmetric.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert higher.loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert PPOConfig(clip_range_high=0.28).clip_bounds == (0.2, 0.28)
    with pytest.raises(UsageError, match="ppo.clip_range_low must be > 0 or null"):
        PPOConfig(clip_range_low=0.0)


@pytest.mark.parametrize(
    ("scale", "expected"),
    [
        ("group", [-1 / math.sqrt(2), 1 / math.sqrt(2), -2 / math.sqrt(8), 2 / math.sqrt(8)]),
        (
            "batch",
            [-1 / math.sqrt(14 / 3), 1 / math.sqrt(14 / 3), -2 / math.sqrt(14 / 3), 2 / math.sqrt(14 / 3)],
        ),
        ("none", [-1.0, 1.0, -2.0, 2.0]),
    ],
)
def test_scale_rewards_divides_grpo_advantages_by_the_group_std_the_batch_std_or_nothing(scale, expected):
    # two groups of two one-token responses scoring 1, 3 and 2, 6
    rewards = torch.tensor([[1.0], [3.0], [2.0], [6.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    config = PPOConfig(advantage_estimator="grpo", num_generations=2, scale_rewards=scale)
    advantages, _ = estimate_advantages(rewards, torch.zeros_like(rewards), mask, config)
    assert advantages[:, 0].tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "constant"])
def test_a_run_trains_with_each_aggregation(aggregation, tiny_digits, tmp_path):
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=DigitsReward(),
        ppo=PPOConfig(
            advantage_estimator="grpo",
            num_generations=2,
            loss_aggregation=aggregation,
            clip_range_high=0.28,
            scale_rewards="none",
            kl_placement="loss",
            kl_estimator="k2",
        ),
        generation=GenerationConfig(max_new_tokens=6),
    )
    assert module.loss_aggregation == F.Aggregation(aggregation, 6)  # constant: max_new_tokens
    before = [p.detach().clone() for p in module.policy.parameters()]
    quiet_trainer(tmp_path, iterations=2).fit(
        module, datamodule=DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)
    )
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))


class PaddingSeen(PPOLightningModule):
    """Records whether a loss pass had padding in its responses (the positions the bug was at)."""

    padded_passes = 0

    def ppo_loss(self, mb, *args):
        PaddingSeen.padded_passes += int((~mb.response_mask).any())
        return super().ppo_loss(mb, *args)


@pytest.mark.parametrize("estimator", ["k2", "k3"])  # k1 is refused in the loss
def test_a_suppressed_pad_token_gives_finite_gradients_with_the_kl_in_the_loss(
    estimator, tiny_digits, tmp_path
):
    """The pad token suppressed (pad != eos): its log-prob at padding positions is -inf, and the KL
    term's gradient there was 0 x inf = NaN in every step (the run stopped after 3 skipped steps)."""
    torch.manual_seed(0)
    PaddingSeen.padded_passes = 0
    module = PaddingSeen(
        policy=str(tiny_digits),
        reward_fn=DigitsReward(),
        ppo=PPOConfig(
            advantage_estimator="grpo", num_generations=2, kl_placement="loss", kl_estimator=estimator
        ),
        generation=GenerationConfig(max_new_tokens=12, suppress_tokens=["<pad>"]),
    )
    assert module.tokenizer.pad_token_id in module.suppressed_ids
    assert module.tokenizer.pad_token_id != module.stop_token_id
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = quiet_trainer(tmp_path, iterations=2)
    trainer.fit(module, datamodule=DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16))
    assert PaddingSeen.padded_passes > 0  # the loss did see padding
    metrics = trainer.callback_metrics
    assert metrics["train/skipped_updates"] == 0 and module.consecutive_skips == 0
    assert math.isfinite(metrics["loss/kl_avg"]) and math.isfinite(metrics["loss/policy_avg"])
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))
