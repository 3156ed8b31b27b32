"""``generation.sync_transport: nccl``: vLLM's own weight transfer, GPU to GPU over NCCL.

Servers started with ``--weight-transfer-config '{"backend": "nccl"}'`` (``lightning-ppo serve
--nccl``) open vLLM 0.32's RLHF routes. The trainer's rank 0 drives them, as vLLM's
``NCCLTrainerWeightTransferEngine`` does for one server, for every server at once:

1. once, ``/init_weight_transfer_engine`` to each server (its workers at ranks ``1 + the workers of
   the servers before it``, of one NCCL group of the trainer and every worker), while rank 0 opens
   its end of the group (rank 0; the workers block in the rendezvous until it does);
2. each sync, ``/start_weight_update``; then per bucket of tensors, ``/update_weights`` with their
   names, dtypes and shapes to every server while rank 0 broadcasts them one by one (both sides
   meet inside the same NCCL calls); then ``/finish_weight_update`` with the weights' version. The
   worker extension's version (``lppo_weights_version``) is cleared before and set after, so a
   sync that failed part way holds no version.

Every call is bounded by ``generation.server_timeout``; a failure of any phase on any server stops
the sync at once in one line naming the phase and the server (an ``/update_weights`` refused before
the broadcast is seen before the next tensor goes). The group is then dropped: the next sync opens
a new one. The data path is :class:`VLLMBroadcaster` (vLLM's ``PyNcclCommunicator``), which needs
CUDA and vLLM in the trainer's environment.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_ppo.rollout.engines.server.checksum import Checksum, checksum
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient

BUCKET_BYTES = 1 << 30  # tensors described by one /update_weights call
_FIELD = "generation.sync_transport: nccl"


class Broadcaster(Protocol):
    """Rank 0's end of the NCCL group: opened once, one broadcast per tensor."""

    def open(self, address: str, port: int, world: int) -> None: ...
    def send(self, tensor: Tensor) -> None: ...
    def close(self) -> None: ...


class VLLMBroadcaster:
    """vLLM's own communicator (``nccl_common.trainer_init``), on this process's CUDA device."""

    def __init__(self) -> None:
        self.group: Any = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def open(self, address: str, port: int, world: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": address, "master_port": port, "world_size": world})

    def send(self, tensor: Tensor) -> None:
        self.group.broadcast(tensor.to(self.device).contiguous(), src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            torch.cuda.current_stream().synchronize()
            group.destroy()


def nccl_refusal() -> str | None:
    """Why this trainer cannot use ``nccl`` (one line), ``None`` where it can."""
    if not torch.cuda.is_available():
        return f"{_FIELD} needs CUDA on the trainer (vLLM's NCCL weight transfer); use memory or file"
    try:
        import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
    except ImportError as err:
        return f"{_FIELD} needs vLLM >= 0.32 in the trainer's environment ({err}); use memory or file"
    return None


class NcclSync:
    """Weights into every server over vLLM's NCCL weight transfer; the group kept between syncs."""

    def __init__(
        self,
        servers: list[ServerClient],
        workers: list[int],
        address: str,
        timeout: float,
        broadcaster: Broadcaster | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.servers, self.workers, self.address, self.timeout = servers, workers, address, timeout
        self.broadcaster = broadcaster if broadcaster is not None else VLLMBroadcaster()
        self.bucket_bytes = bucket_bytes
        self.joined = False
        self._calls = ThreadPoolExecutor(max_workers=max(len(servers), 1), thread_name_prefix="lppo-nccl")

    def load(
        self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Checksum], list[list[Any]]]:
        """Send ``weights`` in ``dtype`` as ``version``; their checksums and each server's workers'
        where ``verify``, as the other transports answer."""
        try:
            if not self.joined:
                self._init()
            self._each("clear version", lambda s: s.rpc_all("lppo_set_version", ""))
            self._each("start_weight_update", lambda s: s.post("/start_weight_update"))
            sums = self._send_all(weights, dtype, verify)
            body = {"weight_version": version}
            self._each("finish_weight_update", lambda s: s.post("/finish_weight_update", body))
            self._each("set version", lambda s: s.rpc_all("lppo_set_version", version))
            held = [s.rpc_all("lppo_checksums") if verify else [] for s in self.servers]
        except BaseException:
            self.close()  # a group stopped part way is unusable: the next sync opens another
            raise
        return sums, held

    def _init(self) -> None:
        world = 1 + sum(self.workers)
        port = _free_port(self.address)
        firsts = [1 + sum(self.workers[:i]) for i in range(len(self.servers))]
        calls = [
            self._calls.submit(self._phase, "init_weight_transfer_engine", server, _init_call(
                self.address, port, first, world, self.timeout))
            for server, first in zip(self.servers, firsts, strict=True)
        ]  # fmt: skip
        try:
            self.broadcaster.open(self.address, port, world)
        except Exception as err:
            raise GenerationServerError(
                f"weight sync ({_FIELD}), phase init_weight_transfer_engine: rank 0 "
                f"at {self.address}:{port} could not open the NCCL group: {type(err).__name__}: {err}"
            ) from None
        _wait(calls)
        self.joined = True

    def _send_all(self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool) -> dict:
        sums, bucket, size = {}, [], 0
        for name, tensor in weights:
            tensor = tensor.detach().to(dtype)
            if verify:
                sums[name] = checksum(tensor)
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                self._send_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._send_bucket(bucket)
        return sums

    def _send_bucket(self, bucket: list[tuple[str, Tensor]]) -> None:
        info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
        calls = [
            self._calls.submit(self._phase, "update_weights", server,
                               lambda s: s.post("/update_weights", {"update_info": info}))
            for server in self.servers
        ]  # fmt: skip
        for _, tensor in bucket:
            _raise_done(calls)  # a server that refused the bucket never meets the broadcast
            self.broadcaster.send(tensor)
        _wait(calls)

    def _each(self, phase: str, call: Any) -> None:
        _wait([self._calls.submit(self._phase, phase, server, call) for server in self.servers])

    @staticmethod
    def _phase(phase: str, server: ServerClient, call: Any) -> Any:
        try:
            return call(server)
        except GenerationServerError as err:
            raise GenerationServerError(
                f"weight sync ({_FIELD}), phase {phase}, failed on {server.url}: {err.what}"
            ) from None

    def close(self) -> None:
        """Drop the NCCL group (the servers keep theirs until the next init replaces it)."""
        self.joined = False
        self.broadcaster.close()


def _init_call(address: str, port: int, first: int, world: int, timeout: float) -> Any:
    init_info = {"master_address": address, "master_port": port, "rank_offset": first, "world_size": world}
    return lambda server: server.post(
        "/init_weight_transfer_engine", {"init_info": init_info}, timeout=timeout
    )


def _raise_done(calls: list[Future]) -> None:
    for call in calls:
        if call.done() and call.exception() is not None:
            raise call.exception()  # type: ignore[misc]


def _wait(calls: list[Future]) -> None:
    """Each call's answer, the first failure raised as soon as it is known (each call is bounded by
    its own timeout, so this returns)."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    _, pending = wait(calls, return_when=FIRST_EXCEPTION)
    _raise_done(calls)
    for call in pending:
        call.result()


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address if address not in ("localhost",) else "127.0.0.1", 0))
        return int(probe.getsockname()[1])
