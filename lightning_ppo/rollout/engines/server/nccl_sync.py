"""``generation.sync_transport: nccl``: vLLM's own weight transfer, GPU to GPU over NCCL.

Servers started with ``--weight-transfer-config '{"backend": "nccl"}'`` (``lightning-ppo serve
--nccl``) open vLLM 0.32's RLHF routes. The trainer's rank 0 drives them, as vLLM's
``NCCLTrainerWeightTransferEngine`` does for one server, for every server at once:

1. once, ``/init_weight_transfer_engine`` to each server (its workers at ranks ``1 + the workers of
   the servers before it``, of one NCCL group of the trainer and every worker), while rank 0 opens
   its end of the group (rank 0; the workers block in the rendezvous until it does). A server
   that fails its init (an error answered, its process gone) is said at once, not after rank 0's
   wait for its workers timed out (:mod:`.nccl_rendezvous`). The
   rendezvous store's port is one the system hands rank 0's socket on ``sync_address``, held from
   then on and served by the store itself: no free port probed, closed and bound again (another
   process, or another sync, could take it in between);
2. each sync, ``/start_weight_update``; then per bucket of tensors, ``/update_weights`` with their
   names, dtypes and shapes to every server while rank 0 broadcasts them one by one (both sides
   meet inside the same NCCL calls); then ``/finish_weight_update`` with the weights' version. The
   worker extension's version (``lppo_weights_version``) is cleared before and set after, so a
   sync that failed part way holds no version; the update it left open on a server (vLLM refuses
   every later start until it is finished) is finished by the next sync, before its start.

Every call is bounded by ``generation.server_timeout``; a failure of any phase on any server stops
the sync at once in one line naming the phase and the server (an ``/update_weights`` refused before
the broadcast is seen before the next tensor goes). The group is then dropped: the next sync opens
a new one. When the engine closes (each ``fit`` ends, however it ends) the servers are asked to
shut their end down (``/shutdown_weight_transfer_engine``) and rank 0 destroys its own: a second
``fit`` in the process opens a new group. The data path is :class:`VLLMBroadcaster` (vLLM's
``PyNcclCommunicator``), which needs CUDA and vLLM in the trainer's environment.
"""

from __future__ import annotations

import math
import socket
import time
import traceback
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_ppo.rollout.engines.server.checksum import Checksum, checksum
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.nccl_rendezvous import Failed, serve_rendezvous
from lightning_ppo.rollout.engines.server.weight_group import listening_socket

BUCKET_BYTES = 1 << 30  # tensors described by one /update_weights call
SHUTDOWN_SECONDS = 10.0  # at most, for a server to let go of its end as a fit ends (a courtesy)
DRAIN_SECONDS = 5.0  # at most, for rank 0's enqueued broadcasts to finish before its end is aborted
_FIELD = "generation.sync_transport: nccl"


class Broadcaster(Protocol):
    """Rank 0's end of the NCCL group: opened once, its rendezvous store served on ``listener`` (a
    socket listening on rank 0's address, whose port the servers were given; closed by the caller
    after, so an implementation serves on a duplicate), one broadcast per tensor. While it waits
    for the servers' workers, ``failed()`` returns a server's failed answer to its init call, if one
    came: raised at once (the workers of a server that failed never come)."""

    def open(self, listener: socket.socket, world: int, timeout: float, failed: Failed) -> None: ...
    def send(self, tensor: Tensor) -> None: ...
    def close(self) -> None: ...


class VLLMBroadcaster:
    """vLLM's own communicator on this process's CUDA device, as ``nccl_common.trainer_init`` opens
    it, but with the rendezvous store served on the socket it is handed rather than one bound again
    by port, and the wait for the workers watching the servers' answers (:mod:`.nccl_rendezvous`)."""

    def __init__(self) -> None:
        self.group: Any = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def open(self, listener: socket.socket, world: int, timeout: float, failed: Failed) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        store = serve_rendezvous(listener, world, max(1, math.ceil(timeout)), failed)
        try:
            rendezvous = StatelessProcessGroup(rank=0, world_size=world, store=store)
            with unpinned_nccl_env():
                group = PyNcclCommunicator(rendezvous, device=self.device)
            if not group.available or group.disabled:  # no NCCL library: its broadcasts would do nothing
                raise RuntimeError("vLLM's PyNcclCommunicator found no usable NCCL library")
        except BaseException as err:
            # The store goes now (Ctrl-C too), not with the error's traceback (a notebook keeps it):
            # the workers waiting in it for NCCL's id stop at once, not at their server_timeout
            store = rendezvous = group = None
            traceback.clear_frames(err.__traceback__)
            raise
        self.group = group

    def send(self, tensor: Tensor) -> None:
        self.group.broadcast(tensor.to(self.device).contiguous(), src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        """The broadcasts enqueued are given :data:`DRAIN_SECONDS` to finish, then the communicator
        is aborted (vLLM's ``destroy``). Not a plain ``synchronize``: after a failed sync a broadcast
        waits for a worker that will never join it, and the trainer would hang there for good."""
        group, self.group = self.group, None
        if group is None:
            return
        drained = torch.cuda.Event()
        drained.record()
        deadline = time.monotonic() + DRAIN_SECONDS
        while not drained.query() and time.monotonic() < deadline:
            time.sleep(0.01)
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
        # A sync's weight update started on the servers and not finished (it failed part way): vLLM's
        # worker refuses every later start until it is (_finish_left)
        self.updating = False
        self._pool: ThreadPoolExecutor | None = None  # the calls to the servers; made by _calls

    def load(
        self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Checksum], list[list[Any]]]:
        """Send ``weights`` in ``dtype`` as ``version``; their checksums and each server's workers'
        where ``verify``, as the other transports answer."""
        try:
            if not self.joined:
                self._init()
            self._each("clear version", lambda s: s.rpc_all("lppo_set_version", ""))
            if self.updating:
                self._finish_left()
            self.updating = True
            self._each("start_weight_update", lambda s: s.post("/start_weight_update"))
            sums = self._send_all(weights, dtype, verify)
            body = {"weight_version": version}
            self._each("finish_weight_update", lambda s: s.post("/finish_weight_update", body))
            self.updating = False
            self._each("set version", lambda s: s.rpc_all("lppo_set_version", version))
            held = [s.rpc_all("lppo_checksums") if verify else [] for s in self.servers]
        except BaseException:
            # A group stopped part way is unusable: the next sync opens another. Rank 0's end only: a
            # worker may still wait in the broadcast, and a call to it would queue behind that wait.
            self._drop()
            raise
        return sums, held

    def _init(self) -> None:
        world = 1 + sum(self.workers)
        try:  # the store's port: the system's choice, held from here until the store serves on it
            listener = listening_socket(self.address)
        except OSError as err:  # not an address of this machine, or a name that does not resolve
            raise GenerationServerError(
                f"generation.sync_address {self.address}: rank 0 cannot listen there ({err}); give an "
                "address of this machine that the servers reach it at"
            ) from None
        with listener:
            port = listener.getsockname()[1]
            firsts = [1 + sum(self.workers[:i]) for i in range(len(self.servers))]
            calls = [
                self._calls().submit(self._phase, "init_weight_transfer_engine", server, _init_call(
                    self.address, port, first, world, self.timeout))
                for server, first in zip(self.servers, firsts, strict=True)
            ]  # fmt: skip
            try:
                self.broadcaster.open(listener, world, self.timeout, partial(_failure, calls))
            except GenerationServerError:  # a server's own line, as soon as it answered
                raise
            except Exception as err:
                _raise_done(calls)  # a server that refused its init: its line, not the wait's end
                raise GenerationServerError(
                    f"weight sync ({_FIELD}), phase init_weight_transfer_engine: rank 0 "
                    f"at {self.address}:{port} could not open the NCCL group: {type(err).__name__}: {err}"
                ) from None
        _wait(calls)
        self.joined = True

    def _finish_left(self) -> None:
        """Ends the weight update a failed sync left open on the servers (those whose update did not
        fail themselves: vLLM's worker ends its own then), after their version was cleared; the
        sync that follows sends every weight. A server with none open refuses: not an error."""
        calls = [self._calls().submit(server.post, "/finish_weight_update") for server in self.servers]
        for call in calls:
            call.exception()  # waited for (each bounded by the server's timeout), never raised
        self.updating = False

    def _calls(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=max(len(self.servers), 1), thread_name_prefix="lppo-nccl"
            )
        return self._pool

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
            self._calls().submit(self._phase, "update_weights", server,
                                 lambda s: s.post("/update_weights", {"update_info": info}))
            for server in self.servers
        ]  # fmt: skip
        for _, tensor in bucket:
            _raise_done(calls)  # a server that refused the bucket never meets the broadcast
            self.broadcaster.send(tensor)
        _wait(calls)

    def _each(self, phase: str, call: Any) -> None:
        _wait([self._calls().submit(self._phase, phase, server, call) for server in self.servers])

    @staticmethod
    def _phase(phase: str, server: ServerClient, call: Any) -> Any:
        try:
            return call(server)
        except GenerationServerError as err:
            raise GenerationServerError(
                f"weight sync ({_FIELD}), phase {phase}, failed on {server.url}: {err.what}"
            ) from None

    def close(self) -> None:
        """The engine closes (a fit ended, however it ended): every server is asked to shut its end
        of the group down, then rank 0 destroys its own and the calls' threads end. Where the group
        was dropped already (a failed sync), only what is left. A server that does not answer within
        :data:`SHUTDOWN_SECONDS` keeps its end until the next init replaces it: not an error, the fit
        is over and the next sync opens a new group either way."""
        if self.joined:
            bound = min(self.timeout, SHUTDOWN_SECONDS)
            shutdowns = [
                self._calls().submit(server.post, "/shutdown_weight_transfer_engine", None, bound)
                for server in self.servers
            ]
            for shutdown in shutdowns:
                shutdown.exception()  # waited for (each bounded), never raised
        self._drop()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)  # a call still out is bounded by its timeout

    def _drop(self) -> None:
        """Rank 0's end of the group destroyed (the servers keep theirs until the next init)."""
        self.joined = False
        self.broadcaster.close()


def _init_call(address: str, port: int, first: int, world: int, timeout: float) -> Any:
    init_info = {"master_address": address, "master_port": port, "rank_offset": first, "world_size": world}
    return lambda server: server.post(
        "/init_weight_transfer_engine", {"init_info": init_info}, timeout=timeout
    )


def _failure(calls: list[Future]) -> BaseException | None:
    """The first failure among the calls answered so far, if any."""
    answered = [call for call in calls if call.done() and not call.cancelled()]
    return next((call.exception() for call in answered if call.exception() is not None), None)


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
