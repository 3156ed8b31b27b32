"""Weights into the servers in memory (``generation.sync_transport: memory``), no disk between.

Once per run, rank 0 serves a gloo group (:mod:`.weight_group`) on ``sync_address`` and asks every
worker of every server to join it (``/collective_rpc`` -> ``lppo_join``: a call that returns once
the group is whole, so it runs on a thread while rank 0 joins too). Each sync then asks every
worker to receive (``lppo_receive``, on threads again) and broadcasts the weights, in the servers'
dtype, in buckets; each worker loads them as they arrive with vLLM's own reload and answers with
the checksums of what it holds, as the file path does. Every wait is bounded by
``generation.server_timeout``: the group's own timeout, and the calls'. A sync that fails anywhere
(a worker's load, a server's answer, the trainer's weights, Ctrl-C) stops every member at once
(:mod:`.weight_group`) and is said at once (the trainer's weights' own error as it is; a pipe
closed with no word, a worker that died: after up to :data:`ANSWER_GRACE_S` for its server's
answer); the group is let go and the next sync joins anew.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor

from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.concurrent_calls import Requests, Stalled
from lightning_ppo.rollout.engines.server.weight_group import (
    BUCKET_BYTES,
    SYNC_HOST_VARIABLE,
    JoinFailed,
    SyncStopped,
    WeightsGroup,
    address_towards,
    listening_socket,
    open_group,
    send,
)
from lightning_ppo.rollout.engines.server.weight_sync import Checksum, checksum

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANSWER_GRACE_S = 5.0  # how long a failed broadcast waits for a server's answer that says why


def sync_address(configured: str | None, urls: list[str]) -> str:
    """Where the servers reach rank 0, one address: as configured (a name resolved here, once),
    else this machine's address towards them."""
    if configured:
        return one_address(configured)
    local = all(urlparse(url).hostname in LOOPBACK for url in urls)
    return "127.0.0.1" if local else address_towards(urlparse(urls[0]).hostname or "")


def one_address(name: str) -> str:
    """``name`` as the one address rank 0 listens on and the servers are told: a name resolved here
    once, to its IPv4 address where it has one (``localhost``: 127.0.0.1, the address chosen for
    servers on this machine when none is set), else its first. Given the name, rank 0 listened on
    the first address its resolver gave (``::1`` on most systems) while a server's resolver could
    give another (``127.0.0.1``), and the join failed at its timeout."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as err:
        raise GenerationServerError(
            f"generation.sync_address {name}: does not resolve here ({err}); give the address the "
            "servers reach this machine at"
        ) from None
    ipv4 = [info[4][0] for info in found if info[0] == socket.AF_INET]
    address = ipv4[0] if ipv4 else found[0][4][0]
    if ipaddress.ip_address(address.partition("%")[0]).is_unspecified:  # told to the servers as it is
        raise GenerationServerError(
            f"generation.sync_address {name}: listens everywhere, but the servers are told this address "
            "and cannot reach rank 0 at it; give this machine's address towards them (null: the one "
            "its route to the first server's URL takes)"
        )
    return address


class MemorySync:
    """The gloo group of rank 0 and the servers' workers (``workers[i]`` for server ``i``)."""

    bucket_bytes = BUCKET_BYTES

    def __init__(self, servers: list[ServerClient], workers: list[int], address: str, timeout: float) -> None:
        self.servers, self.workers, self.address, self.timeout = servers, workers, address, timeout
        self.group: WeightsGroup | None = None
        self.secret = ""

    def load(
        self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Checksum], list[list[Any]]]:
        """Every server holds ``weights`` (in ``dtype``) as ``version``: the trainer's checksums, and
        each server's workers' answers (their checksums where ``verify``)."""
        if self.group is None or not self._still_joined():
            self._let_go()
            self.group = self._join()
        sums: dict[str, Checksum] = {}
        # The group's secret: a call of this sync that reaches a server after a later join is refused.
        receive = ("lppo_receive", "1" if verify else "0", version, self.secret)
        calls = [partial(s.rpc_all, *receive) for s in self.servers]
        own: list[Exception] = []  # what the trainer's weights raised, if they did
        receiving: Requests | None = None
        try:
            # In the try: a Ctrl-C as the calls start leaves them waiting on this group, which the
            # next sync would broadcast on to this sync's calls if it were kept.
            receiving = Requests(calls, len(calls))
            send(
                self.group,
                _noting(_in_dtype(weights, dtype, sums if verify else None), own),
                version,
                receiving.failure,
                self.bucket_bytes,
            )
            return sums, receiving.wait(self.timeout)
        except BaseException as err:
            # A stopped sync leaves the group's order broken (every member was told: send): the next
            # sync joins anew. Ctrl-C included, or a notebook's next fit would send on it.
            self._let_go()
            if not isinstance(err, Exception) or err in own or receiving is None:  # said as it is
                raise
            raise self._failure(err, receiving) from None

    def _failure(self, err: Exception, receiving: Requests) -> BaseException:
        """One error for a sync that failed: the worker that stopped it, the server that answered
        with an error, or what the broadcast itself met. A worker that died closes its pipes before
        its server answers (which names the cause): its answer is awaited a few seconds, and the
        answers that only echo the trainer's own stop (rank 0's) are passed over."""
        if isinstance(err, SyncStopped) and err.rank > 0:
            server, worker = self._worker(err.rank)
            return server.error(
                "/collective_rpc lppo_receive", f"worker {worker} stopped the sync: {err.why}"
            )
        if isinstance(err, GenerationServerError):
            return err
        grace = 0.0 if isinstance(err, Stalled) else min(ANSWER_GRACE_S, self.timeout)  # waited out already
        answered = receiving.failure_within(grace, _not_an_echo)
        return answered or self._error("broadcast", err)

    def _worker(self, rank: int) -> tuple[ServerClient, int]:
        """The server of group rank ``rank``, and the worker's index within it."""
        first = 1
        for server, count in zip(self.servers, self.workers, strict=True):
            if rank < first + count:
                return server, rank - first
            first += count
        return self.servers[-1], rank - first

    def _let_go(self) -> None:
        if self.group is not None:
            self.group.let_go()
            self.group = None

    def _still_joined(self) -> bool:
        """Every worker of every server still holds this group (a restarted server holds none)."""
        return all(held == self.secret for s in self.servers for held in s.rpc_all("lppo_group"))

    def _join(self) -> WeightsGroup:
        world = 1 + sum(self.workers)
        try:
            listener = listening_socket(self.address)  # before the workers are told its port
        except OSError as err:  # not an address of this machine, or a name that does not resolve
            raise GenerationServerError(
                f"generation.sync_address {self.address}: rank 0 cannot listen there ({err}); give an "
                "address of this machine that the servers reach it at"
            ) from None
        port = listener.getsockname()[1]
        self.secret = secrets.token_hex(16)
        calls, first = [], 1
        for server, count in zip(self.servers, self.workers, strict=True):
            # "": each worker gives its own address towards rank 0 (weight_group.advertised_address)
            args = (self.address, str(port), str(world), str(first), str(self.timeout), "", self.secret)
            calls.append(partial(server.rpc_all, "lppo_join", *args, timeout=2 * self.timeout))
            first += count
        joining = Requests(calls, len(calls))
        try:
            group = open_group(
                self.address,
                port,
                0,
                world,
                self.timeout,
                # gloo's device address, given: its default (the machine's name) maps to 127.0.1.1
                # on some systems. ``address`` is already one numeric address (:func:`sync_address`),
                # of rank 0's own family, as gloo needs (it refuses an IPv4 end paired with an IPv6 one).
                self.address,
                self.secret,
                listener,
                failed=joining.failure,  # a worker that cannot join fails the join at once
            )
        except Exception as err:
            raise self._join_error(err, joining.failure()) from None
        try:
            joining.wait(self.timeout)
        except BaseException:  # a server's late error, Ctrl-C: the group is nobody's; the next join anew
            group.let_go()
            raise
        return group

    def _join_error(self, err: BaseException, answered: BaseException | None) -> GenerationServerError:
        """A join that failed, with the address each worker gave the group (those known)."""
        if isinstance(err, GenerationServerError):  # a worker's own line: its address, and why that one
            return err
        given = err.addresses if isinstance(err, JoinFailed) else {}
        workers = ", ".join(
            f"{server.url} worker {worker} at {given.get(rank, 'none given')}"
            for rank in range(1, 1 + sum(self.workers))
            for server, worker in [self._worker(rank)]
        )
        if len(given) < sum(self.workers):
            workers += (
                " (one that gave none never reached rank 0's store, or runs an older `lightning-ppo serve`)"
            )
        why = f"{answered.what}; " if isinstance(answered, GenerationServerError) else ""
        return self._error(
            "joining",
            err,
            f"{why}the group's members: rank 0 at {self.address}, {workers} (each must reach every other "
            f"there; a server's workers give their address towards rank 0, or {SYNC_HOST_VARIABLE} set "
            "where `lightning-ppo serve` runs).",
        )

    def _error(self, what: str, err: BaseException, more: str = "") -> GenerationServerError:
        urls = ", ".join(server.url for server in self.servers)
        said = str(err) if isinstance(err, JoinFailed) else f"{type(err).__name__}: {err}"
        said = said.replace(self.secret, "<secret>") if self.secret else said  # the store's keys hold it
        more = more or f"can they reach {self.address} (generation.sync_address)?"
        return GenerationServerError(
            f"generation servers {urls} (weights in memory, {what}): {said}; {more} "
            "generation.sync_transport 'file' sends the weights through generation.sync_dir instead"
        )


def _not_an_echo(error: BaseException) -> bool:
    """A server's answer says more than that the trainer stopped the sync (which the trainer knows)."""
    return SyncStopped.by(0) not in str(error)


def _noting(weights: Iterator[tuple[str, Tensor]], raised: list[Exception]) -> Iterator[tuple[str, Tensor]]:
    """``weights``, an error they raise (the trainer's gather, its device) noted in ``raised``: it is
    the sync's cause, raised as it is, not a server's answer to the stop it made (:meth:`MemorySync.load`)."""
    try:
        yield from weights
    except Exception as err:
        raised.append(err)
        raise


def _in_dtype(
    weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, sums: dict | None
) -> Iterator[tuple[str, Tensor]]:
    """Each weight on the host in the servers' dtype (rounded once, here); its checksum noted in
    ``sums`` (a sync that is checked: they cost about as much as the broadcast)."""
    for name, tensor in weights:
        tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        if sums is not None:
            sums[name] = checksum(tensor)
        yield name, tensor
