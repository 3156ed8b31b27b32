"""The PPO update reads from the device once per iteration, however its minibatches are split.

A host read (``.item()``, ``float()``, ``.tolist()``...) waits for every kernel queued before it: on a
GPU a read per minibatch stalls the update that many times. Counted on CPU with
``benchmarks.op_count`` (which counts ``tolist``/``numpy`` calls too, as CPU tensors cannot tell a
device read from a host one).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from benchmarks.op_count import OpCounter
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from tests.helpers import CountCharReward, prompt_data, quiet_trainer


class ModelReads:
    """Host reads made inside the Hugging Face models' forwards: transformers' own (its attention
    mask checks ``padding_mask.all()`` before choosing SDPA's causal path), not the update's."""

    def __init__(self, counter: OpCounter, models: list[torch.nn.Module]) -> None:
        self.counter, self.depth, self.reads, self.start = counter, 0, 0, 0
        for model in models:
            for sub in model.modules():
                if isinstance(sub, PreTrainedModel):
                    sub.register_forward_pre_hook(self.enter)
                    sub.register_forward_hook(self.leave)

    def enter(self, *args) -> None:
        if self.depth == 0:
            self.start = self.counter.host_reads
        self.depth += 1

    def leave(self, *args) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.reads += self.counter.host_reads - self.start


@pytest.mark.parametrize(
    "split",
    [{}, {"micro_batch_tokens": 40}, {"gradient_accumulation_steps": 2}, {"max_grad_norm": 1.0}],
    ids=["row-groups", "token-budget", "accumulation", "clipped"],
)
def test_the_update_reads_the_host_once_per_iteration(split, tiny_gpt2, tmp_path):
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_gpt2),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(num_minibatches=2, ppo_epochs=2, **split),
        # sampled stop tokens give responses of several lengths: several row groups per minibatch
        generation=GenerationConfig(max_new_tokens=12, temperature=1.5),
    )
    update, counts = module.ppo_update, []

    def counted_update(exp):
        with OpCounter() as counter:
            models = ModelReads(counter, [m for m in (module.policy, module.value_model) if m is not None])
            out = update(exp)
        counts.append(counter.host_reads - models.reads)
        return out

    module.ppo_update = counted_update
    quiet_trainer(tmp_path, iterations=2).fit(module, datamodule=prompt_data())
    # The one read: every row's attended columns and response length, from which every minibatch's
    # micro-batches are planned on the host. Step flags and statistics stay on the device until the
    # iteration reads what it logs (lightning_ppo.watch.metrics.HostView), after the update.
    assert counts == [1, 1]
