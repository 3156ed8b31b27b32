"""A ``StopIteration`` out of user code inside a step is the user's error, not the end of the data:
Lightning's loops stop an epoch (or a validation) in silence on any StopIteration a step raises."""

from __future__ import annotations

import functools

import pytest
import torch
from lightning.pytorch import Callback

from lightning_ppo import PPOLightningModule
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quickstart_fit_args, quiet_trainer, ranks_process, two_cpu_ranks


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


class WarmsUpOnPrompts(PPOLightningModule):
    """An automatic-optimization subclass (a supervised warm-up on the prompts' tokens): Lightning
    calls the optimizer's hooks (``optimizer_step``, ``on_before_optimizer_step``,
    ``lr_scheduler_step``) from its loop, outside ``training_step``. ``stops_in`` raises
    StopIteration (``next()`` over no match) the first time it is called."""

    def __init__(self, *args, stops_in: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = True
        self.stops_in, self.steps = stops_in, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        logits = self.policy(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask).logits
        return logits.float().logsumexp(-1).mean()

    def optimizer_step(self, *args, **kwargs) -> None:
        self._look("optimizer_step")
        super().optimizer_step(*args, **kwargs)

    def on_before_optimizer_step(self, optimizer) -> None:
        self._look("on_before_optimizer_step")

    def lr_scheduler_step(self, scheduler, metric) -> None:
        self._look("lr_scheduler_step")
        scheduler.step()

    def _look(self, hook: str) -> None:
        if hook == self.stops_in:
            next(iter(()))


@pytest.mark.parametrize("hook", ["optimizer_step", "on_before_optimizer_step", "lr_scheduler_step"])
def test_an_optimizer_hook_called_by_the_loop_raising_stop_iteration_is_named(hook, tiny_digits, tmp_path):
    """A hook whose name ends in ``_step`` is not a step: before, the loop took its StopIteration for
    the end of the data (a ``dataloader_iter`` step's) and the fit returned as done, without a word:
    an epoch of 4 batches ended at its first (the scheduler's, at the first epoch's end: 1 of 2 epochs)."""
    constant = functools.partial(torch.optim.lr_scheduler.ConstantLR, factor=1.0)
    module = WarmsUpOnPrompts(
        policy=str(tiny_digits), reward_fn=DigitsReward(), lr_scheduler=constant, stops_in=hook
    )
    trainer = quiet_trainer(tmp_path, iterations=4)
    trainer.fit_loop.max_epochs = 2
    with pytest.raises(RuntimeError, match=rf"^WarmsUpOnPrompts\.{hook} raised StopIteration") as raised:
        trainer.fit(module, datamodule=_digits())
    assert isinstance(raised.value.__cause__, StopIteration)
    assert module.steps == {"optimizer_step": 0, "lr_scheduler_step": 4}.get(hook, 1)  # it calls the step


class StopsInTheLoop(Callback):
    """A callback whose ``hook``, one of those Lightning's loops call outside the step, raises
    StopIteration (``next()`` over no match) at the second batch or epoch it sees."""

    def __init__(self, hook: str) -> None:
        self.hook, self.seen = hook, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._look("on_train_batch_start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._look("on_train_batch_end")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._look("on_train_epoch_end")

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._look("on_validation_batch_end")

    def _look(self, hook: str) -> None:
        if hook == self.hook:
            self.seen += 1
            if self.seen == 2:
                next(iter(()))


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end", "on_train_epoch_end"])
def test_a_callback_hook_of_the_training_loop_raising_stop_iteration_is_named(hook, tiny_digits, tmp_path):
    """Before, Lightning's loop took it for the end of the epoch (the fit, from on_train_epoch_end)
    and the fit returned as if done: 1 of 4 iterations trained (on_train_batch_start), 2, or 2 of 4
    epochs of one batch."""
    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=DigitsReward())
    stops = StopsInTheLoop(hook)
    trainer = quiet_trainer(tmp_path, iterations=4, callbacks=[stops])
    if hook == "on_train_epoch_end":
        trainer.fit_loop.max_epochs, trainer.limit_train_batches = 4, 1
    with pytest.raises(RuntimeError, match=rf"^StopsInTheLoop\.{hook} raised StopIteration") as raised:
        trainer.fit(module, datamodule=_digits())
    assert isinstance(raised.value.__cause__, StopIteration)
    trained = {"on_train_batch_start": 1, "on_train_batch_end": 2, "on_train_epoch_end": 2}
    assert module.iteration == trained[hook]
    again = quiet_trainer(tmp_path, iterations=4, callbacks=[stops])  # the hook past its bug
    again.fit(module, datamodule=_digits())  # a second fit in the process
    assert module.iteration == trained[hook] + 4


def test_a_callback_hook_of_the_validation_loop_raising_stop_iteration_is_named(tiny_digits, tmp_path):
    """Before, validation ended at its second batch and logged the first's score alone, without a word."""
    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=DigitsReward())
    data = DigitsDataModule(num_prompts=32, num_val_prompts=16, batch_size=8, max_prompt_length=16)
    trainer = quiet_trainer(tmp_path, iterations=1, callbacks=[StopsInTheLoop("on_validation_batch_end")])
    with pytest.raises(RuntimeError, match=r"^StopsInTheLoop\.on_validation_batch_end raised StopIteration"):
        trainer.validate(module, datamodule=data)


class StopsAtTheEdges(Callback):
    """A callback whose ``hook``, one Lightning calls as a loop starts or ends (outside its
    ``try: ... except StopIteration``), raises StopIteration (``next()`` over no match)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def on_train_start(self, trainer, pl_module) -> None:
        self._look("on_train_start")

    def on_train_end(self, trainer, pl_module) -> None:
        self._look("on_train_end")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._look("on_validation_start")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._look("on_validation_epoch_end")

    def _look(self, hook: str) -> None:
        if hook == self.hook:
            next(iter(()))


@pytest.mark.parametrize(
    "hook, run",
    [
        ("on_train_start", "fit"),
        ("on_train_end", "fit"),
        ("on_validation_start", "fit"),  # the sanity check's validation, before the first iteration
        ("on_validation_start", "validate"),
        ("on_validation_epoch_end", "validate"),
    ],
)
def test_a_hook_starting_or_ending_a_loop_raising_stop_iteration_is_named(hook, run, tiny_digits, tmp_path):
    """Before, the StopIteration came out of ``fit``/``validate`` bare (no message, no hook named)."""
    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=DigitsReward())
    data = DigitsDataModule(num_prompts=32, num_val_prompts=16, batch_size=8, max_prompt_length=16)
    trainer = quiet_trainer(tmp_path, iterations=2, callbacks=[StopsAtTheEdges(hook)])
    trainer.limit_val_batches = 1
    with pytest.raises(RuntimeError, match=rf"^StopsAtTheEdges\.{hook} raised StopIteration") as raised:
        getattr(trainer, run)(module, datamodule=data)
    assert isinstance(raised.value.__cause__, StopIteration)
    assert module.iteration == (2 if hook == "on_train_end" else 0)


def test_the_end_of_the_data_and_a_hook_returning_minus_one_still_end_the_epoch(tiny_digits, tmp_path):
    """Lightning's own ways to end an epoch are untouched: the data running out, and
    ``on_train_batch_start`` returning -1 (the next epoch then starts)."""

    class SkipsTheRestAtTheSecond(PPOLightningModule):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None

    module = SkipsTheRestAtTheSecond(policy=str(tiny_digits), reward_fn=DigitsReward())
    trainer = quiet_trainer(tmp_path, iterations=4)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, datamodule=_digits())
    assert module.iteration == 2 and trainer.current_epoch == 2  # one batch in each of the two epochs


class StopsOnRankOne(Callback):
    """Rank 1's ``on_train_batch_end`` raises StopIteration at its first batch; rank 0's never."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1:
            next(iter(()))


@pytest.mark.ranks  # several processes: run alone (tests/conftest.py)
@pytest.mark.long  # 15-26 s: two ranks end to end; the one-process hook tests above stay in make test
def test_a_hook_stop_on_one_rank_of_two_stops_both_with_its_error(tiny_digits, tmp_path):
    """Before, rank 1 ended its fit in silence (exit status 0) and rank 0, in the next iteration's
    all-reduce, failed with gloo's 'Connection closed by peer', which names no hook."""
    stops = {"class_path": "tests.test_stop_iteration.StopsOnRankOne"}
    args = quickstart_fit_args(tiny_digits, tmp_path, [stops], *two_cpu_ranks("ddp", iterations=3))
    done = ranks_process(args, timeout=180)  # a hang is a TimeoutExpired
    assert done.returncode != 0
    assert "StopsOnRankOne.on_train_batch_end raised StopIteration" in done.stderr, done.stderr[-3000:]


async def finds_nothing_async(prompts, completions, batch):
    """``next()`` over no match in an ``async def`` reward ('coroutine raised StopIteration')."""
    return [next(c for c in completions if c == "never")] * len(completions)


def test_an_async_reward_raising_stop_iteration_is_named_as_a_plain_one_is():
    """Before, the error was Python's 'coroutine raised StopIteration', which names no reward."""
    from lightning_ppo.scoring import await_all, call_all

    outputs = call_all([finds_nothing_async], ["1="], ["1"], None, ["finds_nothing_async"])
    with pytest.raises(RuntimeError, match=r"^reward 'finds_nothing_async' raised StopIteration") as raised:
        await_all(outputs, timeout=30.0, names=["finds_nothing_async"], batch_size=1)
    assert isinstance(raised.value.__cause__, StopIteration)
