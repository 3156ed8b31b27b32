"""``ppo.torch_compile``: the loss passes under ``torch.compile`` give eager mode's losses.

Inductor fuses and reorders float32 arithmetic, so the numbers agree to rounding, not bitwise:
measured on CPU (torch 2.13), losses within 3e-8 and gradients within 1.2e-7 of eager mode's
(with dynamic shapes, lightning_ppo.ppo.compiled_loss: losses within 5e-9). How often the loss
compiles is tests/test_compile_count.py's.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.helpers import prompt_data, quiet_trainer
from tests.tolerances import reordered_tolerance


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory: pytest.TempPathFactory):
    """A 1 x 32 Llama: the smallest graph for inductor to compile (a minute on one CPU core)."""
    spec = TinyModelSpec(arch="llama", n_layer=1, n_embd=32, n_head=2)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("one_layer_llama"), spec)


def length_reward(prompts, completions, batch):
    """Scores that vary (a fresh policy's KL is 0): the value loss is then not 0."""
    return [len(c) / 6 for c in completions]


def _first_losses(policy, tmp_path, compiled: bool) -> dict[str, float]:
    seed_everything(0, verbose=False)
    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=length_reward,
        # one minibatch, one epoch: the losses logged are those of the first pass, before any step,
        # so both runs compute them from the same weights and the same rollout
        ppo=PPOConfig(num_minibatches=1, ppo_epochs=1, entropy_coef=0.01, torch_compile=compiled),
        generation=GenerationConfig(max_new_tokens=6),
    )
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=prompt_data(batch_size=4))
    assert (module._compiled_loss is not None) == compiled
    keys = ("loss/policy_avg", "loss/value_avg", "policy/entropy_avg", "val/ratio", "policy/approxkl_avg")
    return {key: float(trainer.callback_metrics[key]) for key in keys}


@pytest.mark.long  # 6 s, 45 s with inductor's cache cold
def test_compiled_loss_passes_give_eager_losses(one_layer_llama, tmp_path):
    eager = _first_losses(one_layer_llama, tmp_path / "eager", compiled=False)
    compiled = _first_losses(one_layer_llama, tmp_path / "compiled", compiled=True)
    assert eager["loss/value_avg"] > 0 and eager["policy/entropy_avg"] > 0
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, abs=reordered_tolerance(value, terms=1.0)), key
    assert torch.compiler.is_compiling() is False  # nothing left in a compiling state
