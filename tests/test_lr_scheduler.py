"""model.lr_scheduler: stepped once after every optimizer step of the PPO update (ppo/schedule.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo import PPOLightningModule
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer


def test_a_scheduler_on_a_monitored_metric_is_refused_in_one_line_before_training(tiny_digits, tmp_path):
    """Before, ReduceLROnPlateau failed after the first rollout and update with torch's TypeError
    ('step() missing 1 required positional argument: metrics'), which names no setting."""
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=DigitsReward(),
        lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau,
    )
    trainer = quiet_trainer(tmp_path, iterations=1)
    data = DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)
    with pytest.raises(
        UsageError, match=r"^model\.lr_scheduler: ReduceLROnPlateau steps on a monitored"
    ) as raised:
        trainer.fit(module, datamodule=data)
    assert "\n" not in str(raised.value)
    assert module.iteration == 0


def test_lightning_clis_own_optimizer_flags_are_refused_in_one_line(tiny_digits, tmp_path, capsys):
    """LightningCLI's ``--optimizer``/``--lr_scheduler`` replaced the module's configure_optimizers
    (the policy's and the critic's parameter groups, each rate, and the ReduceLROnPlateau refusal
    above) in silence: ``--optimizer AdamW`` trained one AdamW over every parameter, exit 0. Now
    refused in one line naming the setting; ``null`` (a saved config's) still passes."""
    from tests.helpers import cli_usage_error, quickstart_fit_args

    args = quickstart_fit_args(tiny_digits, tmp_path, [], "--trainer.limit_train_batches", "1")
    said = cli_usage_error(capsys, [*args, "--optimizer", "AdamW"])
    assert said == (
        "optimizer: LightningCLI's own --optimizer would replace the module's optimizer (its policy and "
        "critic groups and rates); set model.init_args.optimizer instead"
    )
