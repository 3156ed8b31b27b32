"""The check of a weight sync against any model vLLM serves: a mixture of experts stacked as vLLM
stacks it, a quantized layer, and the checksum's memory on the server (a bounded chunk at a time).

The server's side is :func:`worker_extension.checksums` itself, run on a module laid out as vLLM
lays the model out (q/k/v fused, each layer's experts stacked as ``experts.w13_weight`` and
``w2_weight``); the trainer's is a tiny Qwen2-MoE saved and loaded by path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from lightning_ppo.rollout.engines.server.checksum import checksum
from lightning_ppo.rollout.engines.server.weight_sync import mismatch, unchecked
from lightning_ppo.rollout.engines.server.worker_extension import checksums
from lightning_ppo.rollout.engines.weights import hf_weights

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
EXPERTS, MOE = 4, 8


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> nn.Module:
    config = Qwen2MoeConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, moe_intermediate_size=MOE,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=EXPERTS, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = Path(tmp_path_factory.mktemp("moe")) / "policy"
    Qwen2MoeForCausalLM(config).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _checkpoint_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts one tensor each, as a checkpoint names them (``experts.0.down_proj.weight``)."""
    out = {}
    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and module.endswith("experts"):
            for e in range(EXPERTS):
                gate, up = tensor[e].chunk(2)
                out[f"{module}.{e}.gate_proj.weight"], out[f"{module}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and module.endswith("experts"):
            for e in range(EXPERTS):
                out[f"{module}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def _as_vllm_lays_it_out(weights: dict[str, torch.Tensor]) -> nn.Module:
    """A module holding ``weights`` under vLLM's Qwen2-MoE names and layout."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        if part in ("q_proj", "k_proj", "v_proj"):
            held.setdefault(f"{parent}.qkv_proj.{leaf}", [])
            held[f"{parent}.qkv_proj.{leaf}"].append(tensor)
        elif part in ("gate_proj", "up_proj") and "shared_expert" in parent:
            held.setdefault(f"{parent}.gate_up_proj.{leaf}", []).append(tensor)
        elif leaf == "gate_up_proj":
            held[f"{module}.w13_weight"] = tensor  # (experts, 2 x moe, hidden): gate then up
        elif leaf == "down_proj" and module.endswith("experts"):
            held[f"{module}.w2_weight"] = tensor
        else:
            held[name] = tensor
    model = nn.Module()
    for name, value in held.items():
        tensor = torch.cat(value) if isinstance(value, list) else value
        module_name, _, leaf = name.rpartition(".")
        _submodule(model, module_name).register_parameter(leaf, nn.Parameter(tensor.clone()))
    return model


def _submodule(model: nn.Module, name: str) -> nn.Module:
    for part in name.split("."):
        if not hasattr(model, part):
            model.add_module(part, nn.Module())
        model = getattr(model, part)
    return model


def test_a_correct_sync_of_a_mixture_of_experts_model_vllm_stacks_is_verified(moe_policy):
    """Before: refused with "it holds no parameter for 'model.layers.0.mlp.experts.gate_up_proj'" (and
    for 'model.layers.0.mlp.experts.0.down_proj.weight' in a checkpoint's names)."""
    weights = {name: tensor.detach().clone() for name, tensor in hf_weights(moe_policy)}
    held = checksums(_as_vllm_lays_it_out(weights))
    assert "model.layers.1.mlp.experts.w13_weight" in held and "model.layers.1.mlp.experts.w2_weight" in held
    for written in (weights, _checkpoint_names(weights)):
        sums = {name: checksum(tensor) for name, tensor in written.items()}
        assert mismatch(sums, held, PACKED) is None
        assert unchecked(sums, held, PACKED) is None  # every tensor checked, the experts as one whole


def test_a_sync_that_left_one_expert_stale_is_refused_naming_the_stacked_experts(moe_policy):
    weights = {name: tensor.detach().clone() for name, tensor in hf_weights(moe_policy)}
    stale = dict(weights)
    stale["model.layers.1.mlp.experts.down_proj"] = weights["model.layers.1.mlp.experts.down_proj"].clone()
    stale["model.layers.1.mlp.experts.down_proj"][2] *= 1 + 1e-6  # expert 2 kept the old weights
    sums = {name: checksum(tensor) for name, tensor in _checkpoint_names(weights).items()}
    problem = mismatch(sums, checksums(_as_vllm_lays_it_out(stale)), PACKED)
    assert problem is not None and problem.startswith(
        "parameter model.layers.1.mlp.experts.{w13_weight,w2_weight} holds sum"
    ), problem


def test_a_quantized_layer_is_never_refused_and_said_unchecked_in_one_line(moe_policy):
    """An fp8 server's layer holds float8 values and a float32 scale: sums that are not the
    checkpoint's. The sync is not refused; the line says what was verified instead."""
    weights = {name: tensor.detach().clone() for name, tensor in hf_weights(moe_policy)}
    model = _as_vllm_lays_it_out(weights)
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    scale = o_proj.weight.abs().max() / 448
    o_proj.weight = nn.Parameter((o_proj.weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
    o_proj.weight_scale = nn.Parameter(scale.reshape(1))
    sums = {name: checksum(tensor) for name, tensor in weights.items()}
    held = checksums(model)
    assert mismatch(sums, held, PACKED) is None
    note = unchecked(sums, held, PACKED)
    assert note == (
        f"checksums cannot follow 1 of the {len(sums)} written tensors (first "
        "'model.layers.0.self_attn.o_proj.weight'): the server holds them quantized or under other "
        "names; verified for them: the server's load returned and it holds this sync's weights version"
    )


class _LargestAllocation(TorchDispatchMode):
    """The bytes of the largest tensor any operation makes while it is on."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = [*args, *(kwargs or {}).values()]
        viewed = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in viewed:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())  # a new allocation
        return out


@pytest.mark.parametrize("shape", [(1 << 21,), (512, 4096), (3, 2, 1 << 19)])
def test_a_checksum_copies_at_most_one_chunk_and_sums_as_the_whole_does(shape):
    """A 2M-element float32 tensor (8 MB) summed 64 Ki elements at a time: no tensor made above one
    chunk in float64 (512 KiB); the whole tensor's float64 copy (16 MB) before."""
    torch.manual_seed(0)
    tensor = torch.randn(shape)
    chunk = 1 << 16
    with _LargestAllocation() as mode:
        total, squares = checksum(tensor, chunk=chunk)
    assert mode.largest <= chunk * 8, mode.largest
    whole = tensor.double()
    assert total == pytest.approx(whole.sum().item(), rel=0, abs=1e-12 * (whole.numel() * squares) ** 0.5)
    assert squares == pytest.approx(whole.square().sum().item(), rel=1e-12)
    strided = tensor.reshape(-1, 256).T if tensor.numel() % 256 == 0 else tensor
    with _LargestAllocation() as mode:
        assert checksum(strided, chunk=chunk)[1] == pytest.approx(squares, rel=1e-12)
    assert mode.largest <= chunk * 8, mode.largest
