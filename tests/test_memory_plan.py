"""benchmarks/memory_plan.py's accounting against what the real module and FSDP2 hold, in bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import memory_plan
from benchmarks.memory_plan import Settings, build_roles, describe, model_config, plan_memory
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.models.roles import LoraSettings
from tests.helpers import CountCharReward, prompt_data, quiet_trainer

LAYOUTS = {
    "separate": {},
    "shared": {"value_model": "shared"},
    "lora": {"value_model": "shared", "lora": LoraSettings(r=4, alpha=8)},
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class GradientBytes(pl.Callback):
    """The gradients' bytes at the first optimizer step: the only moment they all exist (the
    module sets them to None after every step)."""

    def __init__(self) -> None:
        self.held: int | None = None

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if self.held is None:
            self.held = _bytes(p.grad for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_equals_the_bytes_the_module_holds(layout, tiny_llama, tiny_reward, tmp_path):
    """One process, one PPO iteration (one AdamW step) under bf16-mixed, frozen roles in bf16: the
    plan's trained and frozen weights, gradients and AdamW state for this config are what the module
    holds, to the byte. (The gathered bf16 copies and activations are FSDP2's and the GPU's: not
    measurable here.)"""
    options = dict(LAYOUTS[layout])
    module = PPOLightningModule(
        policy=str(tiny_llama),
        reward_fn=CountCharReward(),
        reward_model=str(tiny_reward),
        reward_weights=[1.0, 1.0],
        frozen_dtype="bf16",
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=4),
        **options,
    )
    grads = GradientBytes()
    trainer = quiet_trainer(tmp_path, 1, [grads], precision="bf16-mixed")  # as the plan assumes for GPUs
    trainer.fit(module, datamodule=prompt_data())
    unique = list({id(p): p for p in module.parameters()}.values())
    state = trainer.optimizers[0].state.values()
    held_adamw = _bytes(t for s in state for t in s.values() if torch.is_tensor(t))

    lora = options.get("lora")
    settings = Settings(ranks=1, frozen_dtype="bf16", **({"lora_r": 4, "lora_alpha": 8} if lora else {}))
    roles = build_roles(model_config(str(tiny_llama)), model_config(str(tiny_reward)), layout, settings)
    plan = plan_memory(roles, settings)
    assert plan.trained == _bytes(p for p in unique if p.requires_grad)
    assert plan.frozen == _bytes(p for p in unique if not p.requires_grad)
    assert plan.grads == grads.held
    assert plan.adamw == held_adamw  # two fp32 moments per weight and a 4-byte step per tensor
    assert plan.frozen > plan.trained if layout == "lora" else plan.trained > plan.frozen


def test_cpu_measurements_reproduced():
    """GPT-2 small, separate layout, fp32: benchmarks/sharded_memory.py measured 4747 MB of tensors
    in one process and 2374 MB per rank under FSDP2 on 2 ranks (docs/performance.md)."""
    (one, planned_one, _), (two, planned_two, _) = memory_plan.cross_check()
    assert (one, round(planned_one)) == (1, 4747)
    assert (two, round(planned_two)) == (2, 2374)


def _held_under_fsdp2(path: str, rank: int, world: int) -> tuple[int, int]:
    """The policy sharded by lightning_ppo's own plan under bf16-mixed as rank ``rank`` of ``world``,
    one backward without gradient sync (an accumulation micro-batch): the bytes of its weight shards
    and of the gradients FSDP2 then keeps. torch's fake process group plays the other ranks in this
    process (collectives do nothing; shapes, shards and buffers are FSDP2's own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_ppo.distributed.sharding import mixed_precision_policy, no_gradient_sync, shard_model
    from lightning_ppo.models.loading import load_causal_lm

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = load_causal_lm(path)
        shard_model(model, init_device_mesh("cpu", (world,)), mixed_precision_policy("bf16-mixed"))
        with no_gradient_sync(model):
            model(input_ids=torch.tensor([[4, 5, 6, 7]])).logits.float().sum().backward()
        groups = [u._get_fsdp_state()._fsdp_param_group for u in model.modules() if isinstance(u, FSDPModule)]
        accumulated = [fp.unsharded_accumulated_grad for g in groups if g for fp in g.fsdp_params]
        shards = _bytes(p.to_local() for p in model.parameters())
        return shards, _bytes(a for a in accumulated if a is not None)
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_and_accumulation_buffers_are_planned(tiny_llama):
    """Rank 0's shard of every weight (ceil(rows / ranks) rows, the most of any rank) and the whole
    fp32 gradient FSDP2 keeps through an accumulation micro-batch are the plan's figures, to the byte."""
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(model_config(str(tiny_llama)), dtype=torch.float32)
    plan = plan_memory([describe("policy", policy)], Settings(ranks=2, accumulation=2))
    rank0, rank1 = (_held_under_fsdp2(str(tiny_llama), rank, 2) for rank in (0, 1))
    assert rank0 == (plan.trained, plan.accumulated)
    assert rank1[0] < rank0[0]  # the vocabulary's 51 rows: 26 on rank 0, 25 on rank 1
    assert plan.accumulated == 4 * sum(p.numel() for p in policy.parameters())  # whole, in fp32


def test_the_7b_gpu_config_fits_by_the_plan():
    """configs/gpu/fsdp2_7b.yaml fits 8 x 80 GB by the plan, states the plan's peak in its header,
    and would not fit with gradient accumulation (FSDP2's whole fp32 gradients)."""
    config = Path(__file__).parents[1] / "configs" / "gpu" / "fsdp2_7b.yaml"
    settings, layout, policy = memory_plan.settings_from_yaml(config)
    assert (policy, layout, settings.ranks, settings.precision) == ("Qwen2.5-7B", "separate", 8, "bf16-mixed")
    plans = {
        n: memory_plan.plan_model(policy, replace(settings, accumulation=n), (layout,))[layout]
        for n in (1, 2)
    }
    assert plans[1].peak <= plans[1].budget < plans[2].peak
    assert f"{memory_plan.gb(plans[1].peak)} GB per rank" in config.read_text()


def test_the_docs_tables_are_the_plans():
    """docs/memory.md's tables and README's peaks are what the script computes for the built-in
    models at its default settings (those of configs/gpu/fsdp2_7b.yaml)."""
    root = Path(__file__).parents[1]
    docs, readme = (root / "docs" / "memory.md").read_text(), (root / "README.md").read_text()
    for model in memory_plan.MODELS:
        plans = memory_plan.plan_model(model, Settings())
        assert memory_plan.markdown_table(plans) in docs
        peaks = " | ".join(memory_plan.gb(plan.peak) for plan in plans.values())
        assert f"| {model} | {peaks} |" in readme
