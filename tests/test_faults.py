"""Numerical faults: non-finite updates are skipped and counted; too many in a row stop the run."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_ppo import GenerationConfig, PPOConfig
from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.runs.errors import RunStopped
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import NaNFromIteration, NaNLossModule, quiet_trainer


def _module(policy, reward=None, optimizer_kwargs=None, nan_steps=(), **ppo):
    config = PPOConfig(**{"ppo_epochs": 2, "num_minibatches": 2, **ppo})
    return NaNLossModule(
        policy=str(policy),
        reward_fn=reward or DigitsReward(),
        ppo=config,
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, **(optimizer_kwargs or {})),
        nan_steps=nan_steps,
    )


def _data():
    return DigitsDataModule(num_prompts=64, num_digits=3, batch_size=8, max_prompt_length=8)


# Fused AdamW (the default) skips on the device; a loop AdamW after the host has read the norm.
@pytest.mark.parametrize("optimizer_kwargs", [{}, {"foreach": False}], ids=["fused", "host-checked"])
def test_a_nan_loss_skips_that_step_and_counts_it(tiny_digits, tmp_path, optimizer_kwargs):
    module = _module(tiny_digits, optimizer_kwargs=optimizer_kwargs, nan_steps={1})
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=_data())
    optimizer = module.optimizers().optimizer
    assert bool(optimizer.param_groups[0]["fused"]) == (not optimizer_kwargs)
    # 4 minibatches, the NaN one did not step: Adam counted 3 updates for every weight.
    assert {float(state["step"]) for state in optimizer.state.values()} == {3.0}
    assert float(trainer.callback_metrics["train/skipped_updates"]) == 1.0
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert module.consecutive_skips == 0  # later good steps reset the streak


def test_nan_every_step_stops_with_a_message(tiny_digits, tmp_path):
    module = _module(tiny_digits, nan_steps=range(100), max_consecutive_skips=3)
    # a deliberate stop: the command prints it in one line and exits 2 (RunStopped is a UsageError)
    with pytest.raises(RunStopped, match="3 optimizer steps in a row had NaN/inf gradients"):
        quiet_trainer(tmp_path, iterations=2).fit(module, datamodule=_data())


def test_reward_nan_forever_stops_and_leaves_the_last_good_checkpoint(tiny_digits, tmp_path):
    module = _module(
        tiny_digits, reward=NaNFromIteration(start=2), on_bad_reward="drop", max_consecutive_skips=2
    )
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    with pytest.raises(RunStopped, match="returned only NaN/inf for 2 iterations in a row"):
        quiet_trainer(tmp_path, iterations=6, callbacks=[saver]).fit(module, datamodule=_data())
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["ppo_state"]["iteration"] == 2  # the last iteration that trained; 3 and 4 were all NaN
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


def test_reward_nan_once_is_dropped_and_counted(tiny_digits, tmp_path):

    def nan_first(prompts, completions, batch):
        return [float("nan")] + [0.5] * (len(completions) - 1)

    module = _module(tiny_digits, reward=nan_first, on_bad_reward="drop")
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=_data())
    assert float(trainer.callback_metrics["reward/dropped"]) == 1.0
    assert trainer.global_step == 4


class NaNAtFirst:
    """0.5 for every sample, except the first batch: NaN throughout (an iteration all dropped)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts, completions, batch):
        self.calls += 1
        return [float("nan") if self.calls == 1 else 0.5] * len(completions)


class NaNMinibatchesModule(NaNLossModule):
    """A NaN loss in every micro-batch of the minibatches listed in ``nan_minibatches`` (counted from 0
    over the run): one NaN optimizer step each, however the minibatch is cut into micro-batches."""

    def __init__(self, *args, nan_minibatches=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nan_minibatches, self.minibatches = set(nan_minibatches), 0

    def train_minibatch(self, micro_batches):
        self.nan_steps = set(range(10_000)) if self.minibatches in self.nan_minibatches else set()
        self.minibatches += 1
        return super().train_minibatch(micro_batches)


def test_a_dropped_iteration_and_nan_steps_are_counted_apart(tiny_digits, tmp_path):
    """Before, both kinds of skip went into one counter: one all-dropped iteration and two NaN steps
    stopped a run under max_consecutive_skips 3 ("3 optimizer steps in a row had NaN/inf")."""
    module = NaNMinibatchesModule(
        policy=str(tiny_digits),
        reward_fn=NaNAtFirst(),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, on_bad_reward="drop", max_consecutive_skips=3),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        nan_minibatches={0, 1},  # the first two steps of iteration 2
    )
    trainer = quiet_trainer(tmp_path, iterations=3)
    trainer.fit(module, datamodule=_data())
    assert module.iteration == 3 and trainer.global_step == 8  # iteration 1 had nothing to learn from
    assert float(trainer.callback_metrics["train/skipped_updates"]) == 0.0  # iteration 3's
    assert module.consecutive_skips == 0 and module.dropped_in_a_row == 0  # both streaks ended
    module = _module(tiny_digits, reward=NaNAtFirst(), on_bad_reward="drop", max_consecutive_skips=1)
    with pytest.raises(FloatingPointError, match="returned only NaN/inf for 1 iterations in a row"):
        quiet_trainer(tmp_path, iterations=3).fit(module, datamodule=_data())


# 16-mixed: the grad scaler skips non-finite steps itself. Lightning turns precision="16-mixed" into
# bf16-mixed on CPU (no scaler), but its fp16 plugin and torch's GradScaler run there when given.
ACCELERATORS = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def _sixteen_mixed(root, iterations: int, accelerator: str) -> pl.Trainer:
    if accelerator == "cuda":
        return quiet_trainer(root, iterations, precision="16-mixed", accelerator="cuda")
    return quiet_trainer(root, iterations, plugins=[MixedPrecision("16-mixed", "cpu")], precision=None)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("optimizer_kwargs", [{}, {"foreach": False}], ids=["fused", "unfused"])
def test_under_16_mixed_the_scalers_skips_are_counted(tiny_digits, tmp_path, optimizer_kwargs, accelerator):
    """Issue 43: under 16-mixed a skipped step read as taken, train/skipped_updates was 0 and
    max_consecutive_skips could never fire while the scaler kept halving its scale."""
    module = _module(tiny_digits, optimizer_kwargs=optimizer_kwargs, nan_steps={1})
    trainer = _sixteen_mixed(tmp_path, 1, accelerator)
    scaler = trainer.precision_plugin.scaler
    start = scaler.get_scale()
    trainer.fit(module, datamodule=_data())
    optimizer = module.optimizers().optimizer
    assert bool(optimizer.param_groups[0].get("fused")) == (not optimizer_kwargs)
    assert {float(state["step"]) for state in optimizer.state.values()} == {3.0}  # 4 minibatches, 1 skipped
    assert scaler.get_scale() == start / 2  # the scaler backed off once: it skipped that step itself
    assert float(trainer.callback_metrics["train/skipped_updates"]) == 1.0
    assert module.consecutive_skips == 0
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_under_16_mixed_nan_every_step_stops(tiny_digits, tmp_path, accelerator):
    module = _module(tiny_digits, nan_steps=range(100), max_consecutive_skips=3)
    trainer = _sixteen_mixed(tmp_path, 2, accelerator)
    with pytest.raises(RunStopped, match="3 optimizer steps in a row had NaN/inf gradients"):
        trainer.fit(module, datamodule=_data())
    assert module.iteration == 1  # stopped at the end of the first iteration (3 of its 4 steps skipped)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_under_16_mixed_a_fused_optimizer_clips_unscaled_gradients(tiny_digits, tmp_path, accelerator):
    """Lightning unscales before on_before_optimizer_step only for optimizers that do not unscale in
    their own step: a fused one's gradients were clipped while still scaled (x 65536), so every step
    was cut to max_grad_norm / 65536 of its size. Fused and unfused SGD now take the same step."""
    trained = {}
    for fused in (True, False):
        module = _module(tiny_digits, ppo_epochs=1, num_minibatches=1, max_grad_norm=0.5)
        module.optimizer_factory = lambda p, fused=fused: torch.optim.SGD(p, lr=0.5, fused=fused)
        before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        torch.manual_seed(0)
        _sixteen_mixed(tmp_path, 1, accelerator).fit(module, datamodule=_data())
        trained[fused] = {
            n: p.detach().cpu() - before[n].cpu() for n, p in module.named_parameters() if n in before
        }
    moved = torch.cat([d.flatten() for d in trained[False].values()]).norm()
    assert moved > 0.05  # lr 0.5 x a gradient clipped to norm 0.5 (or smaller): a step that shows
    for name, delta in trained[True].items():
        torch.testing.assert_close(delta, trained[False][name], rtol=1e-3, atol=1e-6)
