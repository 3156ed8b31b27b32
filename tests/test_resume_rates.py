"""The resume learning-rate warning (runs/resume.say_restored_rates) where the optimizer or its
scheduler is not a plain one: a scheduler that sets the groups' rates itself, param groups of the
user's own optimizer factory, a callback that sets the rate after the restore, as the docs advise."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_ppo import PPOLightningModule
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer

RESUME_WARNING = "resuming restores the checkpoint's optimizer"
HALVED = "model.optimizer.init_args.lr: 0.0005 in the config, 0.001 in the checkpoint"


def _fit(
    policy: Path,
    root: Path,
    optimizer,
    scheduler=None,
    epochs=1,
    ckpt_path=None,
    callbacks=(),
    module_class=PPOLightningModule,
) -> list[str]:
    """One iteration per epoch; the resume warnings about learning rates it gave."""
    torch.manual_seed(0)
    module = module_class(
        policy=str(policy), reward_fn=DigitsReward(), optimizer=optimizer, lr_scheduler=scheduler
    )
    trainer = quiet_trainer(root, iterations=1, callbacks=callbacks, epochs=epochs)
    data = DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(root / "one.ckpt")
    return [str(w.message) for w in caught if RESUME_WARNING in str(w.message)]


SCHEDULERS = {
    # both set each group's rate (and its initial_lr) from their own arguments, not the optimizer's lr
    "OneCycleLR": lambda max_lr=1e-2: partial(
        torch.optim.lr_scheduler.OneCycleLR, max_lr=max_lr, total_steps=1000
    ),
    "CyclicLR": lambda max_lr=1e-2: partial(
        torch.optim.lr_scheduler.CyclicLR,
        base_lr=max_lr / 25,
        max_lr=max_lr,
        step_size_up=50,
        cycle_momentum=False,
    ),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_scheduler_that_sets_the_rates_itself_resumed_unchanged_says_nothing(name, tiny_digits, tmp_path):
    """Before, the saved initial_lr (OneCycleLR's max_lr / 25 = 4e-4, CyclicLR's base_lr, the same)
    was compared with the optimizer's lr 1e-3, which these schedulers do not use: every resume
    warned of a change no one made. A change of the scheduler's own rates is said, naming it."""
    optimizer, scheduler = partial(torch.optim.AdamW, lr=1e-3), SCHEDULERS[name]
    assert _fit(tiny_digits, tmp_path, optimizer, scheduler()) == []
    ckpt = tmp_path / "one.ckpt"
    assert _fit(tiny_digits, tmp_path, optimizer, scheduler(), epochs=2, ckpt_path=ckpt) == []
    said = _fit(tiny_digits, tmp_path, optimizer, scheduler(max_lr=5e-3), epochs=2, ckpt_path=ckpt)
    assert len(said) == 1
    assert "model.lr_scheduler's base rate: 0.0002 in the config, 0.0004 in the checkpoint" in said[0]


class SetsTheRate(pl.Callback):
    """What docs/resuming.md advises to train on at another rate: set it after the restore."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer, pl_module) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = self.lr


def test_a_rate_a_callback_sets_after_the_restore_is_the_config_s_and_says_nothing(tiny_digits, tmp_path):
    assert _fit(tiny_digits, tmp_path, partial(torch.optim.AdamW, lr=1e-3)) == []
    changed = partial(torch.optim.AdamW, lr=5e-4)
    ckpt, callback = tmp_path / "one.ckpt", SetsTheRate(5e-4)
    assert _fit(tiny_digits, tmp_path, changed, epochs=2, ckpt_path=ckpt, callbacks=[callback]) == []


def _no_decay_on_biases(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The common recipe: weight decay on matrices only, as two param groups of the user's own."""
    params = list(params)
    matrices = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr=lr)


def test_an_optimizer_with_param_groups_of_its_own_resumes_and_names_each_changed_rate(tiny_digits, tmp_path):
    """Before, the resume of such a run stopped in on_train_start with 'zip() argument 2 is longer
    than argument 1' (one config field, two groups)."""
    assert _fit(tiny_digits, tmp_path, _no_decay_on_biases) == []
    same = _fit(tiny_digits, tmp_path, _no_decay_on_biases, epochs=2, ckpt_path=tmp_path / "one.ckpt")
    assert same == []
    changed = partial(_no_decay_on_biases, lr=5e-4)
    said = _fit(tiny_digits, tmp_path, changed, epochs=2, ckpt_path=tmp_path / "one.ckpt")
    assert len(said) == 1
    assert HALVED in said[0]
    assert "param group 1's lr: 0.0005 in the config, 0.001 in the checkpoint" in said[0]


class OwnOptimizer(PPOLightningModule):
    """A subclass that builds its optimizer itself, as a Lightning user may (no ``super()``)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_a_subclass_building_its_own_optimizer_resumes(tiny_digits, tmp_path):
    """Before, the resume stopped in on_train_start: "'OwnOptimizer' object has no attribute
    '_built_rates'" (the rates the package's configure_optimizers records, which did not run)."""
    assert _fit(tiny_digits, tmp_path, None, module_class=OwnOptimizer) == []
    ckpt = tmp_path / "one.ckpt"
    assert _fit(tiny_digits, tmp_path, None, epochs=2, ckpt_path=ckpt, module_class=OwnOptimizer) == []


class SetsTheScheduledRate(pl.Callback):
    """docs/resuming.md's advice with a scheduler: set the groups' lr and the scheduler's base_lrs."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer, pl_module) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = self.lr
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        scheduler.base_lrs = [self.lr] * len(scheduler.base_lrs)


def _warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))


def test_a_scheduled_rate_a_callback_sets_after_the_restore_says_nothing(tiny_digits, tmp_path):
    """Before, the comparison read the groups' initial_lr, which a LambdaLR does not schedule from
    (its base_lrs, which the callback set): the run warned that it went on at the checkpoint's rate
    while it trained at the callback's."""
    assert _fit(tiny_digits, tmp_path, partial(torch.optim.AdamW, lr=1e-3), _warmup) == []
    changed, ckpt = partial(torch.optim.AdamW, lr=5e-4), tmp_path / "one.ckpt"
    said = _fit(tiny_digits, tmp_path, changed, _warmup, epochs=2, ckpt_path=ckpt)
    assert len(said) == 1 and HALVED in said[0]  # without the callback: the checkpoint's rate goes on
    callback = SetsTheScheduledRate(5e-4)
    assert _fit(tiny_digits, tmp_path, changed, _warmup, epochs=2, ckpt_path=ckpt, callbacks=[callback]) == []
