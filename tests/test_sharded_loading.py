"""Sharded loading (lightning_ppo.distributed.sharded_loading) on 2 CPU processes (gloo): the roles built as
skeletons, sharded with the FSDP2 plan, then each rank reading its rows of the checkpoint files, hold
exactly the weights ``from_pretrained`` gives today, bit for bit, in every layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import free_port, spawn_forked

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)

LAYOUTS = {
    # critic from the reward model's checkpoint: a classifier's backbone and score head
    "separate": {"value_model": "separate", "value": "reward"},
    # critic from the policy's checkpoint (a backbone read without the LM's prefix); frozen roles in bf16
    "separate-bf16-frozen": {"value_model": "separate", "frozen_dtype": "bf16"},
    # Llama (rotary buffers computed, not loaded), a shared value head
    "shared-llama": {"value_model": "shared", "policy": "llama"},
}


def _build(paths: dict[str, str], layout: dict) -> nn.Module:
    from lightning_ppo.models.roles import Roles
    from lightning_ppo.rewards import RewardModel

    module = nn.Module()
    frozen = layout.get("frozen_dtype")
    module.reward_model = RewardModel.from_pretrained(paths["reward"], dtype=frozen)
    policy = paths[layout.get("policy", "digits")]
    value = paths[layout["value"]] if "value" in layout else None
    module.roles = Roles(policy, value=value, value_model=layout["value_model"], frozen_dtype=frozen)
    return module


def _differences(whole: nn.Module, loaded: nn.Module) -> list[str]:
    """Names whose tensor, dtype or requires_grad differ; parameters compared after ``full_tensor()``."""
    bad = []
    tensors = [*whole.named_parameters(remove_duplicate=False), *whole.named_buffers()]
    for name, expected in tensors:
        got = loaded.get_parameter(name) if isinstance(expected, nn.Parameter) else loaded.get_buffer(name)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        same = got.dtype == expected.dtype and got.requires_grad == expected.requires_grad
        if not (same and torch.equal(got, expected)):
            bad.append(name)
    return bad


def _tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _load_both_ways(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ppo.distributed.sharded_loading import deferred_loading, load_deferred
    from lightning_ppo.distributed.sharding import role_models, shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    report = {}
    try:
        for name, layout in LAYOUTS.items():
            torch.manual_seed(0)
            whole = _build(paths, layout)  # today's: every model loaded whole
            rng = torch.get_rng_state()
            torch.manual_seed(0)
            with deferred_loading():
                loaded = _build(paths, layout)
            on_meta = sum(p.is_meta for p in loaded.parameters())
            for role in role_models(loaded):
                shard_model(role, mesh, None)
            load_deferred(loaded, role_models(loaded), torch.device("cpu"))
            policy = loaded.roles.policy
            report[name] = {
                "on_meta": on_meta,
                "all": sum(1 for _ in loaded.parameters()),
                "left_on_meta": sum(p.is_meta for p in loaded.parameters()),
                "differences": _differences(whole, loaded),
                "same_rng": torch.equal(rng, torch.get_rng_state()),
                "tied": [_tied(policy), _tied(whole.roles.policy)],
                "modes": [m.training for m in loaded.modules()] == [m.training for m in whole.modules()],
                "generation_config": policy.generation_config.to_dict()
                == whole.roles.policy.generation_config.to_dict(),
            }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_sharded_loading_gives_each_rank_todays_weights_in_every_layout(
    tiny_digits, tiny_llama, tiny_reward, tmp_path
):

    paths = {"digits": str(tiny_digits), "llama": str(tiny_llama), "reward": str(tiny_reward)}
    spawn_forked(_load_both_ways, args=(free_port(), paths, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, got in report.items():
            # every parameter but the heads built for real (zeros, as today) was a skeleton's
            assert got["on_meta"] >= got["all"] - 2, (name, got)
            assert got["left_on_meta"] == 0, (name, got)
            assert got["differences"] == [], (name, got)
            assert got["same_rng"] and got["modes"] and got["generation_config"], (name, got)
            assert got["tied"] == [name != "shared-llama"] * 2  # GPT-2 ties its LM head to the embedding


def _moe_with_a_router_bias(out: Path) -> tuple[str, torch.Tensor]:
    """A tiny DeepSeek-V3 (MoE) saved under its own parameter names, its router's correction bias (a
    persistent buffer, zeros at init) set to something else: as a trained MoE checkpoint holds it."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    bias = model.get_buffer("model.layers.1.mlp.gate.e_score_correction_bias")
    with torch.no_grad():
        bias.copy_(torch.linspace(-2.0, 2.0, bias.numel()))
    model.config.save_pretrained(out)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out), bias.clone()


def test_a_skeleton_reads_the_persistent_buffers_its_checkpoint_holds(tmp_path):
    from lightning_ppo.distributed.sharded_loading import deferred_loading, is_skeleton, load_deferred
    from lightning_ppo.models.loading import load_causal_lm

    path, bias = _moe_with_a_router_bias(tmp_path)
    whole = load_causal_lm(path)
    with deferred_loading():
        skeleton = load_causal_lm(path)
    assert is_skeleton(skeleton)  # read tensor by tensor from the files, not whole
    load_deferred(skeleton, [skeleton], torch.device("cpu"))
    assert torch.equal(skeleton.get_buffer("model.layers.1.mlp.gate.e_score_correction_bias"), bias)
    assert _differences(whole, skeleton) == []
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(skeleton(input_ids=ids).logits, whole(input_ids=ids).logits)
