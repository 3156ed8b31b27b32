"""The policy's weights sent to the servers' workers in memory: a gloo group of the trainer
(rank 0) and every worker of every server, and the weights broadcast over it in buckets.

Used by both sides: the trainer (:mod:`.server`) and the worker extension inside each server
(:mod:`.worker_extension`), so this module imports only torch. The group is made from torch's own
parts (a ``TCPStore`` the trainer serves, a ``ProcessGroupGloo`` on it), not
``torch.distributed.init_process_group``: it lives beside the trainer's own process group (DDP,
FSDP2) and the server's, and touches neither.

A bucket is a header (JSON: names, shapes, the dtype; as bytes) and then its tensors, each
broadcast as it is (no packing copy). An empty header ends the weights, so the receiver needs no
list of names beforehand and the sender gathers (FSDP2) one weight at a time. The sender gathers
the next bucket while the last one is on the wire; the receiver takes the next bucket on a thread
while its caller loads this one.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

BUCKET_BYTES = 256 * 2**20  # per broadcast: large enough to stream, small enough to hold twice


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``host`` alone (``port`` 0: a free one), for rank 0's store. Given only a
    port, torch's ``TCPStore`` listens on every interface of the machine (``*:port``), so a group
    meant for 127.0.0.1 would be reachable from the network; given this socket it serves where
    ``host`` says, and no other process can take the port between choosing it and serving on it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def open_group(
    host: str,
    port: int,
    rank: int,
    world: int,
    timeout: float,
    device_host: str | None,
    secret: str = "",
    listener: socket.socket | None = None,
) -> Any:
    """This process's place in the weights group: rank 0 (the trainer) serves the store on ``host:port``
    and the others connect to it; returns once all ``world`` have joined, or raises after ``timeout``
    seconds. ``device_host``: the address the others reach this process at (None: gloo's default,
    the machine's name, which some systems map to 127.0.1.1). ``secret``: the rendezvous keys'
    prefix, handed to the servers over their keyed route, so that a stranger who reaches the
    store's port cannot take a rank's place without guessing it. ``listener`` (rank 0): the
    :func:`listening_socket` it serves on (closed here); without one it binds ``host:port`` itself."""
    wait = timedelta(seconds=timeout)
    if rank == 0:
        store = _serve_store(listener or listening_socket(host, port), world, wait)
    else:
        store = TCPStore(host, port, world, is_master=False, timeout=wait, wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._timeout = wait
    device = ProcessGroupGloo.create_device(hostname=device_host) if device_host else None
    options._devices = [device or ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(PrefixStore(f"lightning-ppo-weights/{secret}", store), rank, world, options)


def _serve_store(listener: socket.socket, world: int, wait: timedelta) -> TCPStore:
    """Rank 0's store, served on ``listener``'s address only. The store gets a duplicate of its
    descriptor (it closes what it serves on), and ours is closed here whatever happens."""
    with listener:
        host, port = listener.getsockname()[:2]
        return TCPStore(
            host,
            port,
            world,
            is_master=True,
            timeout=wait,
            wait_for_workers=False,
            master_listen_fd=os.dup(listener.fileno()),
        )


def send(group: Any, weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Broadcast ``weights`` (contiguous CPU tensors, one dtype) from rank 0, bucket by bucket, then
    the end. A bucket's tensors go as they are (no packing copy), while the next bucket is gathered
    (two buckets in flight at most)."""
    in_flight: list[tuple[Any, Tensor]] = []  # the last bucket's broadcasts, and their tensors
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            in_flight = _send_bucket(group, bucket, in_flight)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        in_flight = _send_bucket(group, bucket, in_flight)
    for work, _ in in_flight:
        work.wait()
    _broadcast(group, torch.zeros(1, dtype=torch.int64))


def receive(group: Any) -> Iterator[tuple[str, Tensor]]:
    """The weights rank 0 sends, one ``(name, tensor)`` at a time, as they arrive; the next bucket
    is received on a thread of its own while the caller loads this one."""
    buckets: queue.Queue[list[tuple[str, Tensor]] | BaseException | None] = queue.Queue(maxsize=1)

    def pull() -> None:
        try:
            while (bucket := _receive_bucket(group)) is not None:
                buckets.put(bucket)
            buckets.put(None)
        except BaseException as err:  # noqa: BLE001  (raised by the loading thread below)
            buckets.put(err)

    threading.Thread(target=pull, name="lightning-ppo-weights", daemon=True).start()
    while (item := buckets.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield from item


def _receive_bucket(group: Any) -> list[tuple[str, Tensor]] | None:
    length = _broadcast(group, torch.zeros(1, dtype=torch.int64))
    if int(length) == 0:
        return None
    header = json.loads(bytes(_broadcast(group, torch.empty(int(length), dtype=torch.uint8)).tolist()))
    dtype = getattr(torch, header["dtype"])
    tensors = [
        (name, torch.empty(shape, dtype=dtype))
        for name, shape in zip(header["names"], header["shapes"], strict=True)
    ]
    works = [group.broadcast([tensor], _from_rank_zero()) for _, tensor in tensors]
    for work in works:
        work.wait()
    return tensors


def _send_bucket(
    group: Any, bucket: list[tuple[str, Tensor]], in_flight: list[tuple[Any, Tensor]]
) -> list[tuple[Any, Tensor]]:
    """Broadcast one bucket's header, then its tensors without waiting for them, once the bucket
    before is sent; the broadcasts, with their tensors kept alive until they end."""
    header = {
        "names": [name for name, _ in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "dtype": str(bucket[0][1].dtype).removeprefix("torch."),
    }
    encoded = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
    for work, _ in in_flight:
        work.wait()
    _broadcast(group, torch.tensor([encoded.numel()], dtype=torch.int64))
    _broadcast(group, encoded)
    return [(group.broadcast([tensor], _from_rank_zero()), tensor) for _, tensor in bucket]


def _broadcast(group: Any, tensor: Tensor) -> Tensor:
    group.broadcast([tensor], _from_rank_zero()).wait()
    return tensor


def _from_rank_zero() -> Any:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return options
