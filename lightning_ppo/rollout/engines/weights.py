"""The policy's weights as a generation engine loads them: Hugging Face names, full tensors.

A LoRA policy is pushed as ``base + delta`` computed out of place, one layer at a time. Merging
the adapter into the base and unmerging it again (PEFT's ``merge_adapter``/``unmerge_adapter``)
writes into the frozen base, and W + D - D != W in floating point: the base, which is also the
reference policy, would drift a little with every push (measured on a bf16 base: 0.33 % of |W|
after 200 pushes, reference log-probs off by up to 7.8e-3).
"""

from __future__ import annotations

from collections.abc import Iterator

from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_ppo.runs.errors import UsageError


def full(tensor: Tensor) -> Tensor:
    """The whole tensor: a DTensor (FSDP2 shard) is gathered, a collective every rank must join."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def lora_delta(layer: LoraLayer) -> Tensor | None:
    """The summed update ``scaling x B @ A`` of the layer's active adapters, shaped as its base
    weight (transposed for GPT-2's Conv1D, ``fan_in_fan_out``), in float32; ``None`` if none is active.

    Computed here from the (gathered) factors rather than by PEFT's ``get_delta_weight``, which
    would multiply FSDP2's sharded DTensors."""
    if layer.disable_adapters:
        return None
    delta = None
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_embedding_A", {}) or layer.use_dora.get(adapter, False):
            raise UsageError(
                "generation.engine 'vllm' pushes LoRA adapters on linear layers only, "
                f"not the embedding or DoRA adapter {adapter!r} of {type(layer.base_layer).__name__}"
            )
        if adapter not in layer.lora_A:
            continue
        update = full(layer.lora_B[adapter].weight).float() @ full(layer.lora_A[adapter].weight).float()
        if layer.fan_in_fan_out:
            update = update.T
        update = update * layer.scaling[adapter]
        delta = update if delta is None else delta + update
    return delta


def hf_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, full tensor) of every weight the engine's model loads, detached.

    A PEFT model's names lose PEFT's prefixes, its adapter tensors are skipped, and each adapted
    weight is yielded as a new tensor ``base + delta`` (the base is never written). DTensor
    shards are gathered (a collective: every rank pushes its engine in the same order).
    """
    if not isinstance(model, PeftModel):
        for name, param in model.named_parameters():
            yield name, full(param).detach()
        return
    layers = model.named_modules()
    adapted = {f"{name}.base_layer.weight": m for name, m in layers if isinstance(m, LoraLayer)}
    for name, param in model.named_parameters():
        if "lora_" in name or "original_module" in name:
            continue
        tensor = full(param).detach()
        layer = adapted.get(name)
        delta = lora_delta(layer) if layer is not None else None
        if delta is not None:
            # float32, whatever the base's dtype: the engine rounds once, to its own dtype
            tensor = tensor.float() + delta.detach()
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name.replace(".modules_to_save.default", ""), tensor
