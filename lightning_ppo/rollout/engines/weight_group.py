"""The policy's weights sent to the servers' workers in memory: a gloo group of the trainer
(rank 0) and every worker of every server, and the weights broadcast over it in buckets.

Used by both sides: the trainer (:mod:`.server`) and the worker extension inside each server
(:mod:`.server_worker`), so this module imports only torch. The group is made from torch's own
parts (a ``TCPStore`` the trainer serves, a ``ProcessGroupGloo`` on it), not
``torch.distributed.init_process_group``: it lives beside the trainer's own process group (DDP,
FSDP2) and the server's, and touches neither.

A bucket is one header and one flat tensor: the header (JSON: names and shapes, the dtype) as
bytes, then the tensors of the bucket concatenated. An empty header ends the weights, so the
receiver needs no list of names beforehand and the sender gathers (FSDP2) one weight at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

BUCKET_BYTES = 256 * 2**20  # per broadcast: large enough to stream, small enough to hold twice


def open_group(host: str, port: int, rank: int, world: int, timeout: float, device_host: str | None) -> Any:
    """This process's place in the weights group: rank 0 (the trainer) serves the store on ``host:port``
    and the others connect to it; returns once all ``world`` have joined, or raises after ``timeout``
    seconds. ``device_host``: the address this process is reached at (None: gloo's default, the
    machine's name)."""
    wait = timedelta(seconds=timeout)
    store = TCPStore(host, port, world, is_master=rank == 0, timeout=wait, wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._timeout = wait
    device = ProcessGroupGloo.create_device(hostname=device_host) if device_host else None
    options._devices = [device or ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(PrefixStore("lightning-ppo-weights", store), rank, world, options)


def send(group: Any, weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Broadcast ``weights`` (CPU tensors, one dtype) from rank 0, bucket by bucket, then the end."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            _send_bucket(group, bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        _send_bucket(group, bucket)
    _broadcast(group, torch.zeros(1, dtype=torch.int64))


def receive(group: Any) -> Iterator[tuple[str, Tensor]]:
    """The weights rank 0 sends, one ``(name, tensor)`` at a time, as they arrive."""
    while True:
        length = _broadcast(group, torch.zeros(1, dtype=torch.int64))
        if int(length) == 0:
            return
        header = json.loads(bytes(_broadcast(group, torch.empty(int(length), dtype=torch.uint8)).tolist()))
        dtype = getattr(torch, header["dtype"])
        shapes = header["shapes"]
        flat = _broadcast(group, torch.empty(sum(_numel(s) for s in shapes), dtype=dtype))
        offset = 0
        for name, shape in zip(header["names"], shapes, strict=True):
            yield name, flat[offset : offset + _numel(shape)].view(shape)
            offset += _numel(shape)


def _send_bucket(group: Any, bucket: list[tuple[str, Tensor]]) -> None:
    dtype = bucket[0][1].dtype
    header = {
        "names": [name for name, _ in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "dtype": str(dtype).removeprefix("torch."),
    }
    encoded = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([encoded.numel()], dtype=torch.int64))
    _broadcast(group, encoded)
    _broadcast(group, torch.cat([t.reshape(-1).to(dtype) for _, t in bucket]))


def _broadcast(group: Any, tensor: Tensor) -> Tensor:
    group.broadcast([tensor], _from_rank_zero()).wait()
    return tensor


def _from_rank_zero() -> Any:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return options


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
