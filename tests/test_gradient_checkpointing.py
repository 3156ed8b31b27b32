"""``gradient_checkpointing: true`` checkpoints the blocks of the trained roles, and lowers the peak
memory of the update's forward and backward (issue 43: Hugging Face models load in eval mode and HF
checkpoints only in training mode, so a full policy and a separate critic checkpointed nothing).

Memory is read from torch's profiler (``profile_memory``): every allocation and free of the CPU
allocator during one minibatch's forward and backward, summed in time order; the peak is the most
bytes live at once above what was live when it started.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.helpers import CountCharReward, prompt_data, quiet_trainer


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4 x 64 Llama: enough blocks for their activations to weigh beside the logits."""
    spec = TinyModelSpec(arch="llama", n_layer=4, n_embd=64)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("llama4"), spec))


def peak_bytes(prof: profile) -> int:
    """The most bytes the CPU allocator held at once during ``prof``, above what it held at its start."""
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak


class MeasuredUpdate(PPOLightningModule):
    """The real module; each minibatch's forward and backward runs under the memory profiler, and the
    blocks' MLPs count the passes that build a graph (a checkpointed block runs twice: forward and
    the backward's recomputation)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peaks: list[int] = []
        self.block_passes = {"policy": 0, "critic": 0}
        self.loss_passes = 0
        policy = self.roles.policy
        roles = {"policy": policy.get_base_model() if self.roles.uses_lora else policy}
        if self.roles.value_model is not None:
            roles["critic"] = self.roles.value_model.backbone
        for name, model in roles.items():
            for block in model.model.layers if hasattr(model, "model") else model.layers:
                # a pre-hook: the recomputation stops inside the MLP, once its last saved tensor is back
                block.mlp.register_forward_pre_hook(self._counter(name))

    def _counter(self, name: str):
        def count(module, args) -> None:
            if torch.is_grad_enabled():  # not generation, not the rollout's no-grad forwards
                self.block_passes[name] += 1

        return count

    def train_minibatch(self, micro_batches):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            stats = super().train_minibatch(micro_batches)
        self.peaks.append(peak_bytes(prof))
        return stats

    def ppo_loss(self, *args, **kwargs):
        self.loss_passes += 1  # one per micro-batch
        return super().ppo_loss(*args, **kwargs)


def fit(policy: str, checkpointing: bool, **kwargs) -> tuple[MeasuredUpdate, dict[str, float]]:
    torch.manual_seed(0)
    module = MeasuredUpdate(
        policy,
        reward_fn=CountCharReward(),
        gradient_checkpointing=checkpointing,
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=24),
        **kwargs,
    )
    trainer = quiet_trainer("unused", iterations=1)
    trainer.fit(module, datamodule=prompt_data(8))
    return module, {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_full_policy_and_critic_checkpoint_their_blocks_and_peak_memory_falls(llama, value_model):
    plain, plain_metrics = fit(llama, False, value_model=value_model)
    checkpointed, metrics = fit(llama, True, value_model=value_model)
    blocks, passes = 4, plain.loss_passes
    assert checkpointed.loss_passes == passes
    critics = ["critic"] if value_model == "separate" else []
    for role in ["policy", *critics]:
        assert plain.block_passes[role] == blocks * passes  # one forward per block
        assert checkpointed.block_passes[role] == 2 * blocks * passes  # and its recomputation
    # training mode with dropout off: the same log-probs as the rollout's eval-mode forward
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/approxkl_avg"] == pytest.approx(plain_metrics["policy/approxkl_avg"], abs=1e-6)
    assert max(checkpointed.peaks) < 0.8 * max(plain.peaks)


def test_generation_runs_in_eval_mode_and_the_roles_are_left_in_it(llama):
    module, _ = fit(llama, True, value_model="separate")
    assert not module.policy.training and not module.roles.value_model.training
    assert not module.ref_policy.training


def test_a_lora_policy_checkpoints_its_blocks(llama):
    plain, _ = fit(llama, False, lora=LoraSettings(r=4))
    checkpointed, _ = fit(llama, True, lora=LoraSettings(r=4))
    assert checkpointed.block_passes["policy"] == 2 * plain.block_passes["policy"] > 0
