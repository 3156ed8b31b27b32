"""A ``StopIteration`` out of user code inside a step is the user's error, not the end of the data:
Lightning's loops stop an epoch (or a validation) in silence on any StopIteration a step raises."""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback

from lightning_ppo import PPOLightningModule
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer


def _digits() -> DigitsDataModule:
    return DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)


class FindsNothingLater(PPOLightningModule):
    """Scores the first batch, then looks for what no completion holds (``next()`` over no match)."""

    def score(self, prompts, completions, batch):
        if self.iteration == 0:
            return [0.0] * len(completions)
        return [float(next(c for c in completions if c == "never"))] * len(completions)


def test_a_score_override_raising_stop_iteration_is_an_error_not_a_shorter_run(tiny_digits, tmp_path):
    """Before, the second iteration's StopIteration ended fit as if its 4 batches were done (1 trained)."""
    module = FindsNothingLater(policy=str(tiny_digits))
    trainer = quiet_trainer(tmp_path, iterations=4)
    with pytest.raises(RuntimeError, match=r"^FindsNothingLater\.score raised StopIteration") as raised:
        trainer.fit(module, datamodule=_digits())
    assert isinstance(raised.value.__cause__, StopIteration)
    assert module.iteration == 1


class StopsIn(Callback):
    """A callback whose ``hook`` raises StopIteration from a helper (``next()`` over no match)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._look("on_before_backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._look("on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._look("on_before_optimizer_step")

    def _look(self, hook: str) -> None:
        if hook == self.hook:
            next(iter(()))


@pytest.mark.parametrize("hook", ["on_before_backward", "on_after_backward", "on_before_optimizer_step"])
def test_a_callback_hook_inside_the_step_raising_stop_iteration_is_named(hook, tiny_digits, tmp_path):
    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=DigitsReward())
    trainer = quiet_trainer(tmp_path, iterations=3, callbacks=[StopsIn(hook)])
    with pytest.raises(RuntimeError, match=rf"^StopsIn\.{hook} raised StopIteration"):
        trainer.fit(module, datamodule=_digits())
    assert module.iteration == 0


class FindsNothingWhenValidating(PPOLightningModule):
    def score(self, prompts, completions, batch):
        if self.trainer.validating:
            next(iter(()))
        return [0.0] * len(completions)


def test_a_score_raising_stop_iteration_in_validation_is_an_error(tiny_digits, tmp_path):
    """Before, validation ended at its first batch and logged nothing, without a word."""
    module = FindsNothingWhenValidating(policy=str(tiny_digits))
    with pytest.raises(RuntimeError, match=r"^FindsNothingWhenValidating\.score raised StopIteration"):
        data = DigitsDataModule(num_prompts=32, num_val_prompts=16, batch_size=8, max_prompt_length=16)
        quiet_trainer(tmp_path, iterations=1).validate(module, datamodule=data)
