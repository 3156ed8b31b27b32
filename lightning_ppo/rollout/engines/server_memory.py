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

import socket
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor

from lightning_ppo.rollout.engines.server_client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server_requests import Requests
from lightning_ppo.rollout.engines.server_sync import Checksum, checksum
from lightning_ppo.rollout.engines.weight_group import open_group, send

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def sync_address(configured: str | None, urls: list[str]) -> str:
    """Where the servers reach rank 0: as configured, else this machine as the servers see it."""
    if configured:
        return configured
    local = all(urlparse(url).hostname in LOOPBACK for url in urls)
    return "127.0.0.1" if local else socket.gethostname()


class MemorySync:
    """The gloo group of rank 0 and the servers' workers (``workers[i]`` for server ``i``)."""

    def __init__(self, servers: list[ServerClient], workers: list[int], address: str, timeout: float) -> None:
        self.servers, self.workers, self.address, self.timeout = servers, workers, address, timeout
        self.group: Any = None

    def load(
        self, weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Checksum], list[list[Any]]]:
        """Every server holds ``weights`` (in ``dtype``) as ``version``: the trainer's checksums, and
        each server's workers' answers (their checksums where ``verify``)."""
        if self.group is None:
            self.group = self._join()
        sums: dict[str, Checksum] = {}
        calls = [partial(s.rpc_all, "lppo_receive", "1" if verify else "0", version) for s in self.servers]
        receiving = Requests(calls, len(calls))
        try:
            send(self.group, _in_dtype(weights, dtype, sums))
        except Exception as err:
            self.group = None  # a broken broadcast leaves the group unusable
            raise receiving.failure() or self._error("broadcast", err) from None
        return sums, receiving.wait(self.timeout)

    def _join(self) -> Any:
        world = 1 + sum(self.workers)
        port = _free_port(self.address)
        device = "127.0.0.1" if self.address in LOOPBACK else ""
        calls, first = [], 1
        for server, count in zip(self.servers, self.workers, strict=True):
            args = (self.address, str(port), str(world), str(first), str(self.timeout), device)
            calls.append(partial(server.rpc_all, "lppo_join", *args))
            first += count
        joining = Requests(calls, len(calls))
        try:
            group = open_group(self.address, port, 0, world, self.timeout, device or None)
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
    weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype, sums: dict
) -> Iterator[tuple[str, Tensor]]:
    """Each weight on the host in the servers' dtype (rounded once, here), its checksum noted."""
    for name, tensor in weights:
        tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        sums[name] = checksum(tensor)
        yield name, tensor


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
