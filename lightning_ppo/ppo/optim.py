"""Optimizer implementation choices that change the speed, never the math.

PPO takes one optimizer step per minibatch (16 per iteration by default), so the step's cost
is paid often: torch's default Adam on CPU loops over the parameters one tensor at a time,
while the fused kernel updates them all at once (2.4x faster on the benchmark's 6.6M-parameter
policy + critic). The fused kernel also takes a ``found_inf`` flag on the device, which lets a
step with NaN/inf gradients be skipped without the host reading the gradient norm.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

# The default learning rates: what peers use to fine-tune language models with PPO (TRL's PPO 3e-6,
# OpenRLHF and verl 1e-6 for the actor and 9e-6 / 1e-5 for the critic; LoRA adapters ~1e-4), not
# torch's 1e-3, which moved a warm-started policy far outside PPO's trust region in one iteration
# (approxkl 4.5, clipfrac 0.55; benchmarks/learning.py measures it on a tiny model). Tiny models from
# random weights learn faster at larger rates, which their configs set (configs/quickstart.yaml).
DEFAULT_LR = 1e-5
DEFAULT_LORA_LR = 1e-4


def default_optimizer(params: Any, lora: bool = False) -> Optimizer:
    """AdamW at :data:`DEFAULT_LR` (:data:`DEFAULT_LORA_LR` when only LoRA adapters train)."""
    return torch.optim.AdamW(params, lr=DEFAULT_LORA_LR if lora else DEFAULT_LR)


# Optimizers whose fused kernels compute the same update as their default loops.
FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
# Devices with fused Adam kernels in every torch this package supports (>= 2.4).
FUSED_DEVICES = ("cpu", "cuda")


def prefer_fused(optimizer: Optimizer) -> bool:
    """Switch Adam/AdamW to the fused kernel when the user left the implementation to torch.

    An explicit ``fused`` or ``foreach`` choice is kept, as are parameters the kernel cannot
    take. Must run before the first step (the step counters' dtype depends on it). Returns
    whether the optimizer now runs fused.
    """
    if type(optimizer) not in FUSABLE:
        return False
    groups = optimizer.param_groups
    user_chose = any(g.get("fused") is not None or g.get("foreach") is not None for g in groups)
    if user_chose or any(g.get("differentiable") for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    if not all(p.device.type in FUSED_DEVICES and torch.is_floating_point(p) for p in params):
        return False
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    return True


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` tensor (fused Adam/AdamW)."""
    return type(optimizer) in FUSABLE and all(g.get("fused") for g in optimizer.param_groups)


def step_unless_nonfinite(optimizer: Optimizer, step: Callable[[], Any], finite: torch.Tensor) -> None:
    """Call ``step()`` so that it updates nothing when ``finite`` is False, without a host sync.

    ``step`` is the (possibly wrapped) optimizer's step; ``optimizer`` must satisfy
    :func:`skips_on_device`. The fused kernel reads the flag on the device and leaves weights,
    moments and step counters untouched, as under AMP's grad scaler.
    """
    optimizer.found_inf = (~finite).float()
    try:
        step()
    finally:
        del optimizer.found_inf


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step did, on the device: no host read."""

    stepped: torch.Tensor  # a bool: False where a NaN/inf gradient skipped it
    grad_norms: torch.Tensor  # each clip's gradient norm before clipping (see clip_per_role)


def step_if_finite(optimizer: Any, max_norms: tuple[float | None, ...]) -> OptimizerStep:
    """Clip (:func:`clip_per_role`), then step unless a gradient is NaN/inf. ``optimizer``: a torch
    optimizer, or Lightning's wrapper of one.

    Fused Adam skips on the device; other optimizers need the host to read the norm first.
    """
    norms = clip_per_role(optimizer, max_norms)
    finite = is_finite(norms).all()
    inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
    if skips_on_device(inner):
        step_unless_nonfinite(inner, optimizer.step, finite)
    elif finite:
        optimizer.step()
    return OptimizerStep(finite, norms)


def clip_per_role(optimizer: Any, max_norms: tuple[float | None, ...]) -> torch.Tensor:
    """Clip the gradients to ``max_norms`` and return the norms before clipping (a device vector).

    One limit: one norm over every param group (the policy and the critic together, the default).
    One per group: each group's own norm and limit (the policy's group, then the critic's:
    lightning_ppo.ppo.param_groups), as verl clips its actor and critic apart. ``None``: measured only.
    """
    sets = [group["params"] for group in optimizer.param_groups]
    if len(max_norms) == 1:
        sets = [[p for params in sets for p in params]]
    norms = [
        grad_norm([p for p in params if p.grad is not None], limit)
        for params, limit in zip(sets, max_norms, strict=True)
    ]
    return torch.stack(norms)


def mean_grad_norms(norms: torch.Tensor, stepped: torch.Tensor) -> torch.Tensor:
    """Each clip's mean gradient norm over the steps taken, 0 where none was: a skipped step's norm is
    NaN/inf. ``norms``: (steps, clips); ``stepped``: (steps,) bools."""
    taken = stepped.unsqueeze(1)
    return torch.where(taken, norms, 0.0).sum(0) / taken.sum().clamp(min=1)


def is_finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)`` in two ops instead of four (abs, ne, eq, mul): ``x - x`` is exactly 0
    for every finite float and NaN for inf and NaN. Called once per optimizer step."""
    return (x - x) == 0


def grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The total gradient norm (a device scalar), clipping to ``max_norm`` when one is given.

    Without a limit the gradients are only measured, not multiplied by a clip factor of 1.
    Sharded (FSDP2, DTensor) gradients give the norm of the whole model, the same on every rank.
    """
    if params and _sharded(params):
        return _sharded_grad_norm([p.grad for p in params], max_norm)
    if max_norm is not None:
        return _local(torch.nn.utils.clip_grad_norm_(params, max_norm))
    measure = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if measure is None:
        return _local(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    return _local(measure([p.grad for p in params]))


def _sharded(params: list[torch.Tensor]) -> bool:
    """Whether every gradient is a DTensor sharded over one 1-D mesh (FSDP2's data-parallel plan)."""
    mesh = getattr(params[0].grad, "device_mesh", None)
    return (
        mesh is not None
        and mesh.ndim == 1
        and all(
            isinstance(p.grad, DTensor) and p.grad.device_mesh == mesh and p.grad.placements[0].is_shard()
            for p in params
        )
    )


def _sharded_grad_norm(grads: list[DTensor], max_norm: float | None) -> torch.Tensor:
    """:func:`grad_norm` of sharded gradients computed on their local shards, as DTensor computes it
    (each tensor's norm over the ranks: one all-reduce of the squared local norms, then the norm
    of those norms; the clip a multiplication of every shard), to the same bits, without DTensor's
    dispatch of one op per tensor (the quickstart's policy and critic, 58 tensors on 2 ranks: 1.1
    against 2.1 ms a step).
    """
    local = [g.to_local() for g in grads]
    squares = torch.stack([torch.linalg.vector_norm(t) for t in local]) ** 2.0
    dist.all_reduce(squares, group=grads[0].device_mesh.get_group())
    total = torch.linalg.vector_norm(squares ** (1.0 / 2.0))
    if max_norm is not None:
        torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _local(norm: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a norm of DTensor gradients (a replicated DTensor), so that the skip
    flag built from it can go to the fused kernel and be stacked with other steps' flags."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def scaler_will_skip(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> torch.Tensor:
    """Under a grad scaler (``16-mixed``), called between the backward and the step: unscale the
    gradients where they are still scaled, and return whether the scaler's step will skip (a device
    bool: a NaN/inf gradient), without a host read.

    Lightning unscales before ``on_before_optimizer_step`` only for optimizers that do not unscale in
    their own step; a fused Adam (the default here on CUDA and CPU) does, so its gradients would be
    clipped scaled (by a factor of 65536 at the start). Unscaled here, the scaler's step passes the
    fused kernel no scale and the same ``found_inf``.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)
    found = scaler._found_inf_per_device(optimizer)  # what scaler.step reads to skip
    if not found:  # no gradients at all: the scaler steps (a no-op)
        return torch.zeros((), dtype=torch.bool)
    device = next(iter(found.values())).device
    return torch.stack([flag.to(device) for flag in found.values()]).sum() > 0


def set_aside_states(optimizers: list[Any], aside: list | None = None) -> list[tuple[Optimizer, Any]]:
    """Take each optimizer's per-parameter state out of it (AdamW's two moments: 8 bytes per trained
    fp32 parameter), leaving it empty; :func:`restore_states` puts it back, the same tensors.

    At the end of ``fit`` Lightning's ``Strategy.teardown`` moves every optimizer's state to the host,
    a copy of it in host memory at the end of every run; an optimizer emptied meanwhile has nothing to
    move, and the state stays on its device for a ``trainer.save_checkpoint`` after ``fit``. Given
    ``aside``, each state is listed there before it leaves its optimizer (a Ctrl-C midway loses none).
    """
    aside = [] if aside is None else aside
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
        aside.append((inner, inner.state))
        inner.state = defaultdict(dict)
    return aside


def restore_states(aside: list[tuple[Optimizer, Any]]) -> None:
    """Put back the states :func:`set_aside_states` took."""
    for optimizer, state in aside:
        optimizer.state = state
