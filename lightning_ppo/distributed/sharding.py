"""Sharded training with FSDP2 (``fully_shard``) under Lightning's ``ModelParallelStrategy``.

The plan: every transformer block of every role model is its own FSDP2 unit (blocks are found
from the Hugging Face model's ``_no_split_modules`` class names, so any architecture works), then
each role's root takes the rest (embeddings, final norm, heads). A role is a parameter-holding
child of the module or of its ``Roles``: policy, frozen reference, critic or shared value head,
reward model. Frozen roles are sharded too, so no rank holds a whole copy of any model.

Lightning's ``FSDPStrategy`` (FSDP1) cannot run manual optimization, which PPO needs: it is
refused up front with a pointer here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from importlib import import_module
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from peft import PeftModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from lightning_ppo.ppo.microbatches import MicroBatch, RowFacts, idle_micro_batch_plan
from lightning_ppo.ppo.row_groups import RowGroup, padded_to
from lightning_ppo.runs.errors import UsageError

FSDP1_ERROR = (
    "Lightning's FSDPStrategy (FSDP1) does not support manual optimization, which PPO uses; shard with "
    "FSDP2 instead: trainer.strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy, "
    "init_args: {data_parallel_size: N, tensor_parallel_size: 1}} (see configs/fsdp2.yaml)"
)


def uses_model_parallel(strategy: Strategy) -> bool:
    """Whether the Trainer's strategy expects the module to shard itself in ``configure_model``."""
    return isinstance(strategy, ModelParallelStrategy)


def reject_fsdp1(strategy: Strategy | str | Any) -> None:
    """Raise for Lightning's FSDP1 strategy, given as an instance, a registered name or a class_path."""
    if isinstance(strategy, str):
        if strategy in FSDPStrategy.get_registered_strategies():
            raise UsageError(FSDP1_ERROR)
        return
    if issubclass(_strategy_class(strategy), FSDPStrategy):
        raise UsageError(FSDP1_ERROR)


def _strategy_class(strategy: Any) -> type:
    class_path = getattr(strategy, "class_path", None)
    if isinstance(class_path, str) and "." in class_path:
        module_name, _, name = class_path.rpartition(".")
        strategy = getattr(import_module(module_name), name, None)
    return strategy if isinstance(strategy, type) else type(strategy)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The strategy's ``data_parallel`` dimension; tensor parallelism is refused.

    The data loader gives every rank its own prompts, so ranks of one tensor-parallel group would
    disagree on their inputs.
    """
    tensor_parallel = mesh["tensor_parallel"].size()
    if tensor_parallel != 1:
        raise UsageError(
            f"lightning_ppo shards data-parallel only (FSDP2): set ModelParallelStrategy's "
            f"tensor_parallel_size to 1 (got {tensor_parallel}) and data_parallel_size to the world size"
        )
    return mesh["data_parallel"]


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """Under ``bf16-mixed`` gather weights in bf16 (half the traffic) but reduce gradients in fp32.

    ``bf16-true``/``16-true`` weights are already in the low dtype, and ``32-true`` computes in
    fp32: no policy. ``ModelParallelStrategy`` accepts no other precision.
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks of every Hugging Face model inside ``model``."""
    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            names.update(module._no_split_modules or [])
    return names


# A model of at most this many bytes is one FSDP2 unit instead of one per block: gathering it whole
# costs next to no memory, and each unit costs two collectives per forward and backward, which is
# what sharded training of small models spends its time on (measured: benchmarks/fsdp2_speed.py).
ONE_UNIT_BYTES = 64 * 2**20


def shard_model(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None, one_unit_bytes: int = 0
) -> None:
    """``fully_shard`` each transformer block of ``model``, then ``model`` itself (its root); only the
    root when the model's parameters take at most ``one_unit_bytes``."""
    kwargs: dict[str, Any] = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    blocks = block_class_names(model)
    size = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    for module in list(model.modules()) if size > one_unit_bytes else []:
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if isinstance(model, PeftModel):
        # PeftModel.generate reaches the base model's forward without calling the PeftModel, so the
        # root's own weights (embeddings, head) would stay sharded: gather them around generate too.
        register_fsdp_forward_method(model, "generate")


def role_models(module: nn.Module) -> list[nn.Module]:
    """The modules the algorithm calls: children of ``module.roles`` and ``module``'s other children."""
    roles = getattr(module, "roles", None)
    children = [c for name, c in module.named_children() if name != "roles"]
    if roles is not None:
        children = list(roles.children()) + children
    return [c for c in children if next(c.parameters(), None) is not None]


def shard_roles(module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None) -> None:
    """Shard every role of a ``PPOLightningModule`` (or subclass) over ``mesh``.

    Raises if a parameter is left unsharded (a subclass's own layer outside the roles): FSDP2 would
    neither synchronise its gradients nor mix it with the sharded ones in one clip or optimizer step.
    """
    for model in role_models(module):
        shard_model(model, mesh, mp_policy, ONE_UNIT_BYTES)
    plain = [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise TypeError(
            f"parameters outside the sharded roles: {plain[:5]}; hold them in a child module of the "
            "LightningModule so that the FSDP2 plan shards them"
        )


def shard_if_model_parallel(module: Any, strategy: Strategy, precision: str) -> None:
    """Shard a ``PPOLightningModule``'s roles when the strategy asks the module to shard itself (only
    ``ModelParallelStrategy``, FSDP2, does). Lightning calls ``configure_model`` once per fit/validate,
    so an already sharded module is left as it is."""
    if uses_model_parallel(strategy) and not is_sharded(module):
        mesh = data_parallel_mesh(module.device_mesh)
        shard_roles(module, mesh, mixed_precision_policy(precision))


def reshard(module: nn.Module) -> None:
    """Free the whole weights FSDP2 still holds after forwards that no backward follows.

    FSDP2 leaves a root unsharded after its forward (a backward usually follows at once and would
    gather it again). The reference and the reward model never have a backward, so without this
    their embeddings and heads would stay whole on every rank through the PPO epochs.
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def most_over_ranks(count: int, device: torch.device) -> int:
    """The largest ``count`` of any rank (a collective: every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return count
    value = torch.tensor([count], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def most_over_ranks_each(counts: list[int], device: torch.device) -> list[int]:
    """The largest of each of ``counts`` over the ranks (a collective: every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return counts
    value = torch.tensor(counts, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.tolist()


def as_many_on_every_rank(
    groups: list[RowGroup], split: int, device: torch.device, sharded: bool
) -> list[RowGroup]:
    """A rank's forward groups, under FSDP2 (where every forward gathers weights from every rank)
    followed by idle forwards up to the most any rank runs (a collective); else unchanged."""
    if not sharded:
        return groups
    return padded_to(groups, most_over_ranks(len(groups), device), split)


def micro_batches_on_every_rank(
    plan: list[list[MicroBatch]], facts: RowFacts, rows: list[np.ndarray], device: torch.device, sharded: bool
) -> list[list[MicroBatch]]:
    """A rank's planned micro-batches of each minibatch (of ``rows``), under FSDP2 (where every
    forward and backward gathers weights from every rank, and the last one reduce-scatters) followed
    by idle ones of weight 0 up to the most any rank runs (one collective and one host read for
    every minibatch of the iteration); else unchanged."""
    if not sharded:
        return plan
    most = most_over_ranks_each([len(micro) for micro in plan], device)
    return [
        micro + [idle_micro_batch_plan(facts, r)] * (n - len(micro))
        for micro, r, n in zip(plan, rows, most, strict=True)
    ]


def is_sharded(module: nn.Module) -> bool:
    """Whether any submodule of ``module`` is an FSDP2 unit."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


@contextmanager
def no_gradient_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded) in every FSDP2 unit: FSDP2's ``no_sync``.

    The next backward outside this context reduce-scatters the accumulated sum, as DDP's
    ``no_sync`` defers its all-reduce.
    """
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


@contextmanager
def gathered_for_generation(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Keep a sharded model's blocks gathered through a whole generation, then shard them again.

    Generation runs one forward per new token; FSDP2 gathers every block before each forward and
    frees it after, so a 16-token reply cost 16 all-gathers per block. With its blocks left whole
    after their first forward (``set_reshard_after_forward(False)``, as DeepSpeed ZeRO-3 gathers
    for generation) the reply costs one per block. The price is the policy's whole weights on
    every rank while it generates (``enabled=False``, ``generation.gather_for_generation: false``, keeps
    the per-token gathers instead). Outside FSDP2 this does nothing.

    Gathered, a decoding step communicates nothing (the root stays whole after its forward too), so
    a rank whose replies all ended may stop: Hugging Face's ``synced_gpus``, on for FSDP-managed
    models, would have every rank all-reduce a "finished" flag and read it on the host at every new
    token, and keep stepping until all ranks are done; ``generate`` is called without it here.
    """
    blocks = [u for u in model.modules() if enabled and isinstance(u, FSDPModule) and u is not model]
    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    unsynced = enabled and is_sharded(model)
    own_generate = model.__dict__.get("generate")  # PEFT's, made an FSDP2 forward method in shard_model
    if unsynced:
        model.generate = partial(model.generate, synced_gpus=False)
    try:
        yield
    finally:
        if unsynced:
            if own_generate is None:
                del model.generate
            else:
                model.generate = own_generate
        for block in blocks:
            block.set_reshard_after_forward(True, recurse=False)
            block.reshard()
