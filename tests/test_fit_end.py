"""The end of a stage (issue 43): Lightning's Strategy.teardown (single device, DDP) moves the module
and every optimizer's state to the host at the end of fit, validate and test: a host copy of every
role (trained and frozen) and of AdamW's moments (8 bytes per trained parameter). The module's
strategy runs it with the roles and the state set aside (``models.placement.keep_through_teardown``),
so teardown finds nothing to move, and puts them back after, where they ran; what may follow a fit
still works: a full ``trainer.save_checkpoint`` that resumes, ``validate``, a second ``fit``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule
from tests.helpers import PROMPTS, CountCharReward


class TeardownWitness(SingleDeviceStrategy):
    """Lightning's own single-device strategy; records the bytes its teardown moves to the host: the
    optimizers' state and the module's parameters and buffers (on a GPU each would be copied)."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.moved: list[int] = []

    def teardown(self) -> None:
        module = self.lightning_module
        tensors = [*module.parameters(), *module.buffers()] if module is not None else []
        weights = sum(t.numel() * t.element_size() for t in tensors)
        self.moved.append(sum(_state_bytes(o) for o in self.optimizers) + weights)
        super().teardown()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())


def _module(policy) -> PPOLightningModule:
    return PPOLightningModule(
        str(policy),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=6),
    )


def _trainer(root, strategy, iterations: int = 1) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=iterations,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def _data() -> PromptDataModule:
    return PromptDataModule(prompts=PROMPTS, val_prompts=PROMPTS[:4], batch_size=4, max_prompt_length=8)


def test_teardown_moves_nothing_and_a_save_after_fit_resumes(tiny_gpt2, tmp_path):
    module, strategy = _module(tiny_gpt2), TeardownWitness()
    trainer = _trainer(tmp_path, strategy, iterations=2)
    trainer.fit(module, datamodule=_data())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    # was every role (policy, critic, frozen reference: 4 bytes per parameter each) and AdamW's two
    # fp32 moments (8 bytes per trained parameter)
    assert strategy.moved == [0]
    assert _roles(module) == {"policy", "ref_policy", "value_model"}  # back after teardown, as they were
    assert not any(p.is_meta for p in module.parameters()) and module.device == strategy.root_device
    assert _state_bytes(trainer.optimizers[0]) == 8 * trained
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizers[0].state_dict()["state"].items()}

    trainer.save_checkpoint(tmp_path / "after.ckpt")  # after fit, with the moments: it can resume
    saved = torch.load(tmp_path / "after.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    for key, value in moments.items():
        torch.testing.assert_close(saved[key]["exp_avg"], value, rtol=0, atol=0)
    resumed = _trainer(tmp_path, "auto", iterations=2)  # the saved run was done: it loads, trains no more
    resumed.fit(_module(tiny_gpt2), datamodule=_data(), ckpt_path=tmp_path / "after.ckpt")
    assert resumed.global_step == 2 * 2
    loaded = resumed.optimizers[0].state_dict()["state"]
    for key, value in moments.items():
        torch.testing.assert_close(loaded[key]["exp_avg"], value, rtol=0, atol=0)


def test_validate_and_a_second_fit_follow_a_fit(tiny_gpt2, tmp_path):
    module, strategy = _module(tiny_gpt2), TeardownWitness()
    trainer = _trainer(tmp_path, strategy)
    data = _data()
    trainer.fit(module, datamodule=data)
    validated = trainer.validate(module, datamodule=data, verbose=False)
    assert torch.isfinite(torch.tensor(validated[0]["eval/scores"]))
    assert strategy.moved == [0, 0]  # validate's teardown keeps them too
    again = TeardownWitness()
    _trainer(tmp_path, again).fit(module, datamodule=data)  # a new optimizer, set aside in turn
    assert module.iteration == 2 and again.moved == [0]
    assert _roles(module) == {"policy", "ref_policy", "value_model"}


def test_a_teardown_that_raises_leaves_the_roles_in_place(tiny_gpt2, tmp_path):
    class Failing(TeardownWitness):
        def teardown(self) -> None:
            super().teardown()
            raise RuntimeError("teardown failed")

    module, strategy = _module(tiny_gpt2), Failing()
    with pytest.raises(RuntimeError, match="teardown failed"):
        _trainer(tmp_path, strategy).fit(module, datamodule=_data())
    assert _roles(module) == {"policy", "ref_policy", "value_model"}
    assert _state_bytes(strategy.optimizers[0]) > 0


def _roles(module: PPOLightningModule) -> set[str]:
    """The roles holding parameters: ``roles.<role>.…`` of every parameter's name."""
    return {name.split(".")[1] for name, _ in module.named_parameters()}


class Interrupted(BaseException):
    """As a Ctrl-C's KeyboardInterrupt (a BaseException), without stopping pytest itself."""


class InterruptedOnce(torch.optim.SGD):
    """An optimizer whose first new state is interrupted (a Ctrl-C landing while the states are set aside)."""

    interrupted = False

    def __setattr__(self, name, value) -> None:
        if name == "state" and hasattr(self, "state") and not self.interrupted:
            super().__setattr__("interrupted", True)
            raise Interrupted
        super().__setattr__(name, value)


def test_a_state_set_aside_before_an_interrupt_is_listed_and_put_back():
    from lightning_ppo.ppo.optim import restore_states, set_aside_states

    weights = torch.nn.Parameter(torch.ones(3))
    first = torch.optim.SGD([weights], lr=0.1, momentum=0.9)
    weights.grad = torch.ones(3)
    first.step()
    momentum = first.state[weights]["momentum_buffer"]
    aside: list = []
    try:
        set_aside_states([first, InterruptedOnce([torch.nn.Parameter(torch.ones(1))], lr=0.1)], aside)
    except Interrupted:
        pass
    assert len(first.state) == 0 and aside[0][0] is first  # taken out, and listed before it left
    restore_states(aside)
    assert first.state[weights]["momentum_buffer"] is momentum
