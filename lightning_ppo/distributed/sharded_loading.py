"""Loading the roles' weights where they run: whole on one device, or shard by shard under FSDP2, so
that no rank holds a whole model.

Built inside :func:`deferred_loading` (``PPOLightningModule`` builds its roles so under every
strategy: lightning_ppo.models.placement), every Hugging Face model of the module is a skeleton: built from
its config with its parameters on the meta device (its buffers, computed from the config, are real),
remembering where each parameter lies in the checkpoint's safetensors files. ``configure_model``
shards the roles under FSDP2, then :func:`load_deferred` gives each meta parameter memory on the
root device and reads into it the rows of the file that its rank's shard holds (FSDP2 shards dim 0;
elsewhere every row), with plain reads at file offsets: each rank reads 1/N of every file and never
maps a whole one. A persistent buffer the checkpoint holds (an MoE router's correction bias) is read
the same way, whole; everything else built for real (value heads, LoRA adapters, buffers computed
from the config) keeps its value, so the weights are those a whole ``from_pretrained`` gives.

A checkpoint that is not plain safetensors holding every parameter under the model's own names
(``.bin`` files, renamed or fused keys) is loaded whole as before: slower to start, the same weights.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

_DEFERRING: ContextVar[bool] = ContextVar("lightning_ppo_deferring", default=False)
SOURCES = "lightning_ppo_checkpoint_sources"  # of a skeleton: {parameter or buffer name: TensorSource}
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@contextmanager
def deferred_loading() -> Iterator[None]:
    """Models built inside are skeletons whose weights :func:`load_deferred` reads later, sharded."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def deferring() -> bool:
    return _DEFERRING.get()


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor lies in a safetensors file: its bytes start at ``offset``, row-major."""

    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Skeleton:
    model: PreTrainedModel
    missing: list[str]  # parameters no checkpoint tensor fills (transformers would initialise them)


def read_header(file: str) -> dict[str, TensorSource]:
    """Every tensor of a safetensors file, from its JSON header (no tensor data is read)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {
        name: TensorSource(
            file, 8 + size + info["data_offsets"][0], _DTYPES[info["dtype"]], tuple(info["shape"])
        )
        for name, info in header.items()
        if info["dtype"] in _DTYPES
    }


def checkpoint_tensors(name_or_path: str) -> dict[str, TensorSource] | None:
    """The tensors of a local folder's or cached hub checkpoint's safetensors files; ``None`` without."""
    index = _resolve(name_or_path, SAFE_WEIGHTS_INDEX_NAME)
    if index is not None:
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        files = [_resolve(name_or_path, shard) for shard in shards]
        if None in files:
            return None
    else:
        files = [_resolve(name_or_path, SAFE_WEIGHTS_NAME)]
        if files[0] is None:
            return None
    return {name: source for file in files for name, source in read_header(file).items()}


def _resolve(name_or_path: str, filename: str) -> str | None:
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, filename)
        return path if os.path.isfile(path) else None
    try:
        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` without a device makes meta tensors. Parameters are made so (``nn.Linear``,
    ``nn.Embedding``, norms, GPT-2's ``Conv1D``), so they are never allocated for real. A moment's
    allocation of every weight costs nothing resident, but each large block glibc hands back raises its
    mmap threshold (up to 32 MiB), after which the run's own buffers come from the heap, which keeps
    what it frees: GPT-2 small's four roles peaked 210 MB higher in training that way (5910 MB
    against 5701, ``benchmarks.sharded_memory``, one process)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


_ON_META: ContextVar[bool] = ContextVar("lightning_ppo_parameters_on_meta", default=False)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if not _ON_META.get() or param is None or param.is_meta:
        return None  # a tied weight is registered again, or made on meta: keep it the same object
    return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


# torch's parameter registration hooks are the process's: one hook, held for good, that acts only in a
# thread building a skeleton. Added and removed around each build, another thread's parameters
# went to meta too, and its registration, iterating the hooks as they changed, raised "OrderedDict
# mutated during iteration" (tests/test_skeleton_threads.py).
torch.nn.modules.module.register_module_parameter_registration_hook(_to_meta)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside, on this thread, moves to the meta device as it is registered
    (most are made there: :class:`_EmptyOnMeta`, a mode of this thread's alone); buffers computed from
    the config stay real. Initialising on meta is free."""
    token = _ON_META.set(True)
    try:
        with _EmptyOnMeta():
            yield
    finally:
        _ON_META.reset(token)


def build_skeleton(
    auto_class: Any,
    name_or_path: str,
    config: PretrainedConfig,
    trust_remote_code: bool,
    dtype: torch.dtype | None,
) -> Skeleton | None:
    """``auto_class`` built from ``config`` as ``from_pretrained`` builds it, parameters on meta, each
    mapped to its checkpoint tensor; ``None`` when the checkpoint has no safetensors files."""
    tensors = checkpoint_tensors(name_or_path)
    if tensors is None:
        return None
    with _parameters_on_meta():
        model = auto_class.from_config(
            config, trust_remote_code=trust_remote_code, dtype=dtype or _checkpoint_dtype(config, tensors)
        )
    model.eval()  # as from_pretrained leaves it
    if model.can_generate():
        model.generation_config = _generation_config(name_or_path)
    sources, missing = _map_parameters(model, tensors)
    buffers = _map_buffers(model, tensors)
    if any(buffer.is_meta for name, buffer in model.named_buffers() if name not in buffers):
        return None  # a buffer made with torch.empty and filled in __init__: its values would be lost
    setattr(model, SOURCES, {**sources, **buffers})
    return Skeleton(model, missing)


def _checkpoint_dtype(config: PretrainedConfig, tensors: dict[str, TensorSource]) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` picks: the config's, else the first float tensor's."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        floats = (s.dtype for s in tensors.values() if s.dtype.is_floating_point)
        dtype = next(floats, torch.get_default_dtype())
    return dtype


def _generation_config(name_or_path: str) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(name_or_path)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        return GenerationConfig.from_pretrained(
            name_or_path, config_file_name="config.json", _from_model_config=True
        )


def _map_parameters(
    model: PreTrainedModel, tensors: dict[str, TensorSource]
) -> tuple[dict[str, TensorSource], list[str]]:
    """Each parameter's checkpoint tensor, under any of its names (a tied weight has two), with or
    without the base model's prefix (a backbone read from a checkpoint of the model with a head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else None
    sources, missing = {}, []
    for name, param in model.named_parameters():
        candidates = names[id(param)]
        if prefix:
            candidates = [c for n in candidates for c in (n, prefix + n, n.removeprefix(prefix))]
        found = [tensors[c] for c in candidates if c in tensors and tensors[c].shape == tuple(param.shape)]
        if found:
            sources[name] = found[0]
        else:
            missing.append(name)
    return sources, missing


def _map_buffers(model: PreTrainedModel, tensors: dict[str, TensorSource]) -> dict[str, TensorSource]:
    """The checkpoint tensor of each persistent buffer the checkpoint holds, as ``from_pretrained``
    reads them (a trained MoE router's correction bias is not its init value of 0). A persistent
    buffer the checkpoint lacks keeps its value from the config, as there; non-persistent ones
    (rotary frequencies) are never in a checkpoint."""
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else None
    sources = {}
    for name, buffer in model.named_buffers():
        parent, _, attr = name.rpartition(".")
        if attr in model.get_submodule(parent)._non_persistent_buffers_set:
            continue
        candidates = [name, prefix + name, name.removeprefix(prefix)] if prefix else [name]
        found = [tensors[c] for c in candidates if c in tensors and tensors[c].shape == tuple(buffer.shape)]
        if found:
            sources[name] = found[0]
    return sources


def defer_child(model: nn.Module, child: str) -> nn.Module:
    """The child module ``child`` of a skeleton, holding the sources of its own parameters."""
    module = model.get_submodule(child)
    sources = getattr(model, SOURCES)
    setattr(
        module,
        SOURCES,
        {n.removeprefix(f"{child}."): s for n, s in sources.items() if n.startswith(f"{child}.")},
    )
    return module


def defer_copy(owner: nn.Module, model: nn.Module, names: dict[str, str]) -> None:
    """``owner``'s parameters (its own name -> a parameter name of the skeleton ``model``) are read from
    the checkpoint tensors of ``model``'s: moved to meta now, filled with the rest of the skeleton."""
    sources = getattr(model, SOURCES)
    taken = {own: sources[theirs] for own, theirs in names.items() if theirs in sources}
    for own in taken:
        parent, _, attr = own.rpartition(".")
        module = owner.get_submodule(parent)
        param = getattr(module, attr)
        setattr(module, attr, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))
    setattr(owner, SOURCES, {**getattr(owner, SOURCES, {}), **taken})


def is_skeleton(model: nn.Module) -> bool:
    return hasattr(model, SOURCES)


def load_deferred(module: nn.Module, roles: list[nn.Module], device: torch.device) -> None:
    """Materialise every role of ``module`` holding skeleton parameters on ``device``, sharded or whole,
    and read their weights; what was real before keeps its value. A no-op once loaded."""
    owners = [m for m in module.modules() if is_skeleton(m)]
    for role in roles:
        if any(t.is_meta for t in [*role.parameters(), *role.buffers()]):
            _materialise(role, device)
    for owner in owners:
        for name, source in getattr(owner, SOURCES).items():
            _read_shard(_tensor(owner, name), source)
        delattr(owner, SOURCES)


def _tensor(owner: nn.Module, name: str) -> Tensor:
    """The parameter, else the buffer, that ``owner`` registers as ``name``."""
    parent, _, attr = name.rpartition(".")
    module = owner.get_submodule(parent)
    return module._parameters[attr] if attr in module._parameters else module.get_buffer(attr)


def _materialise(role: nn.Module, device: torch.device) -> None:
    """``to_empty`` (from the role's root, so that FSDP2 re-registers its shards), then the real
    tensors' values back. Aliases (``detach``) suffice: ``to_empty`` gives a parameter new storage,
    either as a new tensor or, between devices of one kind, by swapping its ``.data`` in place."""
    kept = {
        name: (t.to_local() if isinstance(t, DTensor) else t).detach()
        for name, t in [*role.named_parameters(), *role.named_buffers()]
        if not t.is_meta
    }
    tied = _tied_names(role)
    role.to_empty(device=device)
    _retie(role, tied)
    now = {**dict(role.named_parameters()), **dict(role.named_buffers())}
    with torch.no_grad():
        for name, old in kept.items():
            new = now[name]
            (new.to_local() if isinstance(new, DTensor) else new).copy_(old)


def _tied_names(role: nn.Module) -> list[list[str]]:
    """The names of each parameter that is registered under several (a tied embedding and LM head)."""
    names: dict[int, list[str]] = {}
    for name, param in role.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _retie(role: nn.Module, tied: list[list[str]]) -> None:
    """Tie again what ``to_empty`` untied: moving off the meta device gives each registration a new
    parameter (no shallow copy between meta and a real device), one of which the read would miss."""
    for first, *others in tied:
        param = role.get_parameter(first)
        for name in others:
            parent, _, attr = name.rpartition(".")
            if role.get_parameter(name) is not param:
                setattr(role.get_submodule(parent), attr, param)


def shard_rows(param: Tensor) -> tuple[int, int]:
    """The rows (dim 0) of ``param``'s whole tensor that this rank holds: all of a plain tensor, FSDP2's
    ``Shard(0)`` chunk of a DTensor (ceil(n / world) rows per rank, the last ranks' fewer or none)."""
    rows = param.shape[0]
    if not isinstance(param, DTensor):
        return 0, rows
    if tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"sharded loading reads Shard(0) placements, not {param.placements}")
    chunk = math.ceil(rows / param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * chunk, rows)
    return start, min(start + chunk, rows)


@torch.no_grad()
def _read_shard(param: Tensor, source: TensorSource) -> None:
    """Read this rank's rows of ``source`` into ``param``'s local tensor (cast to its dtype)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    start, stop = shard_rows(param) if param.dim() else (0, 1)
    if local.shape[:1] != (stop - start,) and param.dim():
        raise RuntimeError(
            f"local shard of shape {tuple(local.shape)} is not rows {start}:{stop} of {source}"
        )
    row_bytes = math.prod(source.shape[1:]) * source.dtype.itemsize
    direct = local.dtype == source.dtype and local.device.type == "cpu" and local.is_contiguous()
    # On the host whatever the default device: configure_model runs under the strategy's device context.
    target = local if direct else torch.empty(local.shape, dtype=source.dtype, device="cpu")
    buffer = memoryview(target.detach().view(-1).view(torch.uint8).numpy())
    with open(source.file, "rb") as f:
        f.seek(source.offset + start * row_bytes)
        read = 0
        while read < len(buffer):  # readinto may return fewer bytes than asked
            n = f.readinto(buffer[read:])
            if not n:
                raise OSError(f"{source.file}: ends before the tensor it declares")
            read += n
    if not direct:
        local.copy_(target)
