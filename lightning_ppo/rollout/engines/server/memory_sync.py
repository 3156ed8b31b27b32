"""Weights into the servers in memory (``generation.sync_transport: memory``), no disk between.

Once per run, rank 0 serves a gloo group (:mod:`.weight_group`) on ``sync_address`` and asks every
worker of every server to join it (``/collective_rpc`` -> ``lppo_join``: a call that returns once
the group is whole, so it runs on a thread while rank 0 joins too). Each sync then asks every
worker to receive (``lppo_receive``, on threads again) and broadcasts the weights, in the servers'
dtype, in buckets; each worker loads them as they arrive with vLLM's own reload and answers with
the checksums of what it holds, as the file path does. Every wait is bounded by
``generation.server_timeout``: the group's own timeout, and the calls'.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor

from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.concurrent_calls import Requests
from lightning_ppo.rollout.engines.server.weight_group import listening_socket, open_group, send
from lightning_ppo.rollout.engines.server.weight_sync import Checksum, checksum

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def sync_address(configured: str | None, urls: list[str]) -> str:
    """Where the servers reach rank 0: as configured, else this machine's address towards them."""
    if configured:
        return configured
    local = all(urlparse(url).hostname in LOOPBACK for url in urls)
    return "127.0.0.1" if local else _address_towards(urlparse(urls[0]).hostname or "")


def _address_towards(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet is sent): not its
    name, which some systems map to 127.0.1.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


class MemorySync:
    """The gloo group of rank 0 and the servers' workers (``workers[i]`` for server ``i``)."""

    def __init__(self, servers: list[ServerClient], workers: list[int], address: str, timeout: float) -> None:
        self.servers, self.workers, self.address, self.timeout = servers, workers, address, timeout
        self.group: Any = None
        self.secret = ""

    def load(
        self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Checksum], list[list[Any]]]:
        """Every server holds ``weights`` (in ``dtype``) as ``version``: the trainer's checksums, and
        each server's workers' answers (their checksums where ``verify``)."""
        if self.group is None or not self._still_joined():
            self.group = self._join()
        sums: dict[str, Checksum] = {}
        calls = [partial(s.rpc_all, "lppo_receive", "1" if verify else "0", version) for s in self.servers]
        receiving = Requests(calls, len(calls))
        try:
            send(self.group, _in_dtype(weights, dtype, sums if verify else None))
            return sums, receiving.wait(self.timeout)
        except Exception as err:
            self.group = None  # a broken sync leaves the group unusable: the next one joins anew
            failure = receiving.failure()
            if failure is None and isinstance(err, GenerationServerError):
                raise
            raise failure or self._error("broadcast", err) from None

    def _still_joined(self) -> bool:
        """Every worker of every server still holds this group (a restarted server holds none)."""
        return all(held == self.secret for s in self.servers for held in s.rpc_all("lppo_group"))

    def _join(self) -> Any:
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
            # each worker is reached at the address the trainer reaches its server at
            device = _device_host(urlparse(server.url).hostname or "")
            args = (self.address, str(port), str(world), str(first), str(self.timeout), device, self.secret)
            calls.append(partial(server.rpc_all, "lppo_join", *args))
            first += count
        joining = Requests(calls, len(calls))
        try:
            group = open_group(
                self.address, port, 0, world, self.timeout, _device_host(self.address), self.secret, listener
            )
        except Exception as err:
            raise joining.failure() or self._error("joining", err) from None
        joining.wait(self.timeout)
        return group

    def _error(self, what: str, err: Exception) -> GenerationServerError:
        urls = ", ".join(server.url for server in self.servers)
        return GenerationServerError(
            f"generation servers {urls} (weights in memory, {what}): {type(err).__name__}: {err}; "
            f"can they reach {self.address} (generation.sync_address)? generation.sync_transport "
            "'file' sends the weights through generation.sync_dir instead"
        )


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


def _device_host(address: str) -> str:
    """The address gloo advertises for a process: explicit, since its default (the machine's name)
    maps to 127.0.1.1 on some systems, which other machines cannot reach."""
    return "127.0.0.1" if address in LOOPBACK else address
