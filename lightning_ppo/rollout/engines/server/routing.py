"""Which server each request of a batch goes to: the one expected to answer it first, below a limit
of this rank's requests in flight per server.

A request is routed as it is sent, not when the batch is made. Each server's latency (the median
seconds from sending a request to its answer) is measured in every batch that sends it any
(:class:`Latencies`); a request goes to the server that should answer it soonest: at once where it
has a free slot, after its next free slot where it is full (a full server frees its slots at about
``limit / latency`` a second). So a server measured slower is sent fewer, and none where waiting
for a faster one's slot is sooner: with one server 4x slower, the others take the whole batch in
two waves rather than the slow one hold a quarter of it for its one long wave. Latencies within a
quarter of the best count as equal (a measurement is noisy), and among those the server with a
free slot and the fewest in flight takes the request: servers not measured yet (the first batch),
or measured alike, fill evenly, as verl's ``AsyncLLMServerManager`` spreads its requests. A
server left without requests keeps its last latency for :data:`FORGET_AFTER` batches, then is
estimated as the slowest of the others and sent requests again, so that it is measured again.

A server is full at its limit (``generation.server_max_in_flight``, shared by the ranks:
:func:`rank_shares`); a batch runs at most its share of each server at once, so one that fits in
every server's room goes out in one wave. Routing is deterministic given the latencies and the
order the answers come in; each rank measures and routes its own requests within its own shares.

Everything here runs on the engine's event loop (:mod:`.connections`), one batch at a time: no lock.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass, field

# Expected answer times within this fraction of the soonest count as equal (measurements are noisy).
SLACK = 0.25
# Batches a server left without requests keeps its last measured latency before it is tried again.
FORGET_AFTER = 8


def rank_shares(limit: int, ranks: int, rank: int, servers: int) -> list[int]:
    """Requests ``rank`` may have in flight on each server, so that every rank's together are each
    server's ``limit`` exactly, however many ranks: ``limit // ranks`` each, and each server's
    ``limit % ranks`` slots left over dealt out in turn over all servers (server 0's to ranks 0, 1,
    ..., server 1's to the next ones), so a rank gets at most one more than another in all. A
    limit rounded up per rank would overfill every server (3 ranks at 8: 9 each; 4 ranks at 2: 4).
    Only where the ranks outnumber every server's slots together is a rank left without any: it
    gets one on server ``rank mod servers`` (a server queues it; a rank that sends nothing would
    wait forever)."""
    base, extra = divmod(limit, ranks)
    shares = [base + int((rank - server * extra) % ranks < extra) for server in range(servers)]
    if not any(shares):
        shares[rank % servers] = 1
    return shares


@dataclass
class Latencies:
    """Each of ``servers``' median latency (seconds from a request sent to its answer) in the last
    batch that sent it requests, and how many batches ago that was."""

    servers: int
    measured: list[float | None] = field(init=False)
    age: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.measured, self.age = [None] * self.servers, [0] * self.servers

    def estimates(self) -> list[float]:
        """A latency per server for the next batch: its own where measured within
        :data:`FORGET_AFTER` batches, else the slowest of those (all alike where none is)."""
        known = [self._known(server) for server in range(self.servers)]
        fill = max((latency for latency in known if latency is not None), default=1.0)
        return [fill if latency is None else latency for latency in known]

    def record(self, took: list[list[float]]) -> None:
        """A batch's latencies, each server's list (empty where it was sent none)."""
        for server, seconds in enumerate(took):
            if seconds:
                self.measured[server], self.age[server] = statistics.median(seconds), 0
            else:
                self.age[server] += 1

    def _known(self, server: int) -> float | None:
        return self.measured[server] if self.age[server] < FORGET_AFTER else None


class Router:
    """Hands each request of a batch a server, at most ``limits[server]`` in flight on each, the
    one with the soonest expected answer under ``latencies`` (all alike where not given).

    Ties go to the server first after ``first`` (the rank: each rank starts its batch on another
    server, so a few requests from every rank do not all land on server 0)."""

    def __init__(self, limits: list[int], first: int = 0, latencies: list[float] | None = None) -> None:
        servers = len(limits)
        self.limits = limits
        self.latencies = latencies or [1.0] * servers
        self.order = [(first + step) % servers for step in range(servers) if limits[(first + step) % servers]]
        self.in_flight = [0] * servers
        self.peaks = [0] * servers
        self.sent = [0] * servers
        self.took: list[list[float]] = [[] for _ in range(servers)]  # this batch's latencies
        self.waiting: list[deque[asyncio.Future[None]]] = [deque() for _ in range(servers)]
        self.assigned: dict[int, int] = {}  # a request's index in the batch: its server

    async def take(self, request: int) -> int:
        """The server for ``request``, counted in flight there until :meth:`give_back`; where it is
        full, once it frees a slot (handed to the requests waiting for it in turn)."""
        server = self._soonest()
        if self.in_flight[server] < self.limits[server]:
            self.in_flight[server] += 1
        else:
            slot = asyncio.get_running_loop().create_future()
            self.waiting[server].append(slot)
            try:
                await slot
            except asyncio.CancelledError:
                if slot.done() and not slot.cancelled():  # handed the slot as it was cancelled
                    self.give_back(server)
                raise
        self.peaks[server] = max(self.peaks[server], self.in_flight[server])
        self.sent[server] += 1
        self.assigned[request] = server
        return server

    def give_back(self, server: int, seconds: float | None = None) -> None:
        """``server``'s request is answered, after ``seconds`` (or failed, or was cancelled: None);
        its slot goes to the next request waiting for it, if any."""
        if seconds is not None:
            self.took[server].append(seconds)
        waiting = self.waiting[server]
        while waiting:
            slot = waiting.popleft()
            if not slot.done():  # a waiter cancelled meanwhile is passed over
                slot.set_result(None)
                return
        self.in_flight[server] -= 1

    def _soonest(self) -> int:
        """The server expected to answer a request sent now soonest (within :data:`SLACK`): one
        with a free slot before a full one, then the fewest in flight, then the first in order."""
        expected = {server: self._expected(server) for server in self.order}
        bound = min(expected.values()) * (1 + SLACK)
        near = [server for server in self.order if expected[server] <= bound]
        return min(near, key=self._load)

    def _expected(self, server: int) -> float:
        """Seconds until a request sent to ``server`` now is answered: its latency, after a wait for a
        slot where it is full (a slot frees every latency / limit seconds, taken in turn)."""
        latency, limit = self.latencies[server], self.limits[server]
        if self.in_flight[server] < limit:
            return latency
        return latency + (len(self.waiting[server]) + 1) * latency / limit

    def _load(self, server: int) -> tuple[bool, int]:
        held = self.in_flight[server]
        return held >= self.limits[server], held + len(self.waiting[server])

    def room(self) -> int:
        """How many requests the batch may run at once."""
        return sum(self.limits)

    def used(self) -> list[int]:
        """The servers sent a request of this batch."""
        return [index for index, count in enumerate(self.sent) if count]

    def holding(self, requests: list[int]) -> tuple[int, int]:
        """The server ``requests`` (unanswered) were sent to most, and how many of them it holds
        (the first server and all of them where none was sent yet)."""
        counts = [0] * len(self.in_flight)
        for request in requests:
            if request in self.assigned:
                counts[self.assigned[request]] += 1
        server = max(range(len(counts)), key=lambda index: counts[index])
        return server, counts[server] or len(requests)
