"""Sharded loading (lightning_ppo.distributed.sharded_loading) on 2 CPU processes (gloo): the roles built as
skeletons, sharded with the FSDP2 plan, then each rank reading its rows of the checkpoint files, hold
exactly the weights ``from_pretrained`` gives today, bit for bit, in every layout."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

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

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    paths = {"digits": str(tiny_digits), "llama": str(tiny_llama), "reward": str(tiny_reward)}
    mp.spawn(_load_both_ways, args=(port, paths, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, got in report.items():
            # every parameter but the heads built for real (zeros, as today) was a skeleton's
            assert got["on_meta"] >= got["all"] - 2, (name, got)
            assert got["left_on_meta"] == 0, (name, got)
            assert got["differences"] == [], (name, got)
            assert got["same_rng"] and got["modes"] and got["generation_config"], (name, got)
            assert got["tied"] == [name != "shared-llama"] * 2  # GPT-2 ties its LM head to the embedding
