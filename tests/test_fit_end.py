"""The end of fit (issue 43): Lightning's Strategy.teardown copies every optimizer's state to the host
(AdamW: 8 bytes per trained parameter, on top of the module). The module sets the state aside before
it and puts it back after, so teardown finds nothing to copy, and what may follow a fit still works:
a full ``trainer.save_checkpoint`` that resumes, ``validate``, a second ``fit``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule
from tests.helpers import PROMPTS, CountCharReward


class TeardownWitness(SingleDeviceStrategy):
    """Lightning's own single-device strategy; records the optimizer state bytes its teardown moves."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.moved: list[int] = []

    def teardown(self) -> None:
        self.moved.append(sum(_state_bytes(o) for o in self.optimizers))
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


def test_teardown_moves_no_optimizer_state_and_a_save_after_fit_resumes(tiny_gpt2, tmp_path):
    module, strategy = _module(tiny_gpt2), TeardownWitness()
    trainer = _trainer(tmp_path, strategy, iterations=2)
    trainer.fit(module, datamodule=_data())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert strategy.moved == [0]  # was 8 bytes per trained parameter: AdamW's two fp32 moments
    assert _state_bytes(trainer.optimizers[0]) == 8 * trained  # back after teardown
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
    again = TeardownWitness()
    _trainer(tmp_path, again).fit(module, datamodule=data)  # a new optimizer, set aside in turn
    assert module.iteration == 2 and again.moved == [0]
