"""The gradient norm of FSDP2's sharded gradients (``ppo.optim.grad_norm``) at its edges, on 2 CPU
ranks: parameters smaller than the world size (a rank holds an empty shard: a value head's bias),
bf16 and mixed-dtype gradients, a NaN or an inf on one rank only. Every rank must take the same skip
and clip decision (the norm is the same bits on every rank), and the norm and clip stay torch's own
on the DTensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, spawn_forked

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)

# (shapes, dtypes): dim 0 of 1 leaves rank 1 an empty shard (a 1-output head's weight and bias)
LAYOUTS = {
    "empty shards": ([(3, 4), (1,), (1, 5), (7,)], ["float32"] * 4),
    "bf16": ([(3, 4), (1,), (8, 5), (7,)], ["bfloat16"] * 4),
    "mixed dtypes": ([(3, 4), (1,), (8, 5), (7,)], ["bfloat16", "float32", "float32", "bfloat16"]),
}
POISONS = {"finite": None, "nan on rank 1": float("nan"), "inf on rank 1": float("inf")}


def _sharded_grads(mesh, rank: int, shapes: list, dtypes: list, poison: float | None) -> list:
    """Parameters sharded as FSDP2 shards them, with the same gradients on every call; ``poison``
    written into rank 1's shard of the first one."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    params = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        param = torch.nn.Parameter(
            distribute_tensor(torch.zeros(shape, dtype=getattr(torch, dtype)), mesh, [Shard(0)])
        )
        grad = torch.randn(shape, generator=generator) * (100.0 if i % 2 else 1.0)
        param.grad = distribute_tensor(grad.to(getattr(torch, dtype)), mesh, [Shard(0)])
        if poison is not None and i == 0 and rank == 1:
            param.grad.to_local().view(-1)[0] = poison
        params.append(param)
    return params


def _norm_edges(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ppo.ppo.optim import grad_norm, is_finite

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        found = {}
        for (layout, (shapes, dtypes)), (poisoned, poison) in (
            (la, po) for la in LAYOUTS.items() for po in POISONS.items()
        ):
            for clip in (None, 1.0):
                params = _sharded_grads(mesh, rank, shapes, dtypes, poison)
                ours = grad_norm(params, clip)
                clipped = [p.grad.to_local().clone() for p in params]
                params = _sharded_grads(mesh, rank, shapes, dtypes, poison)
                if clip is None:
                    theirs = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
                else:
                    theirs = torch.nn.utils.clip_grad_norm_(params, clip).full_tensor()
                same = [
                    torch.equal(ours.isnan(), theirs.isnan()) and ours.nan_to_num().equal(theirs.nan_to_num())
                ]
                for mine, p in zip(clipped, params, strict=True):
                    same.append(mine.nan_to_num().equal(p.grad.to_local().nan_to_num()))
                every = [torch.zeros((), dtype=ours.dtype) for _ in range(2)]
                dist.all_gather(every, ours.detach().clone())
                found[f"{layout}, {poisoned}, clip {clip}"] = {
                    "as torch": all(same),
                    "every rank's norm": [repr(n.item()) for n in every],
                    "steps": bool(is_finite(ours)),
                }
        Path(out, f"norms{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def test_sharded_norm_is_one_decision_on_every_rank_at_its_edges(tmp_path):
    spawn_forked(_norm_edges, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"norms{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == len(LAYOUTS) * len(POISONS) * 2
    for case, found in ranks[0].items():
        assert found == ranks[1][case], case  # the same norm, the same step or skip, on both ranks
        assert found["as torch"], case
        first, second = found["every rank's norm"]
        assert first == second, case
        assert found["steps"] == ("finite" in case), case  # one rank's NaN/inf skips every rank's step
