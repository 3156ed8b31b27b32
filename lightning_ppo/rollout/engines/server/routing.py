"""Which server each request of a batch goes to: the one with the fewest of this rank's requests in
flight, below a limit per server.

A request is routed as it is sent, not when the batch is made: a server that answers slowly keeps
its requests longer, so it has fewer slots free and is sent fewer, and the others take the rest
(verl's ``AsyncLLMServerManager`` picks the server it has sent the fewest requests so far, a count
that never goes down as they are answered: even servers get even shares, a slow one too). A
server whose requests all wait behind its batch is full at the limit (``generation.
server_max_in_flight``, shared by the ranks: :func:`rank_share`); a batch runs at most ``limit``
requests per server at once, so one that fits in every server's room goes out in one wave.

Everything here runs on the engine's event loop (:mod:`.connections`), one batch at a time: no lock.
"""

from __future__ import annotations

import math


def rank_share(limit: int, ranks: int) -> int:
    """Requests one rank may have in flight on one server, so that every rank's together fill the
    server's ``limit`` (rounded up: a share of 0 would send nothing)."""
    return max(1, math.ceil(limit / ranks))


class Router:
    """Hands each request of a batch a server among ``servers``, at most ``limit`` in flight each.

    Ties go to the server first after ``first`` (the rank: each rank starts its batch on another
    server, so a few requests from every rank do not all land on server 0)."""

    def __init__(self, servers: int, limit: int, first: int = 0) -> None:
        self.limit = limit
        self.first = first % servers
        self.in_flight = [0] * servers
        self.peaks = [0] * servers
        self.sent = [0] * servers
        self.assigned: dict[int, int] = {}  # a request's index in the batch: its server

    def take(self, request: int) -> int:
        """The server for ``request``, counted in flight there until :meth:`give_back`. The batch
        runs at most ``limit`` x servers requests at once (:meth:`room`), so one has room."""
        servers = len(self.in_flight)
        order = [(self.first + step) % servers for step in range(servers)]
        server = min(order, key=lambda index: self.in_flight[index])
        if self.in_flight[server] >= self.limit:
            raise RuntimeError(f"no server has room for request {request}: {self.in_flight} in flight")
        self.in_flight[server] += 1
        self.peaks[server] = max(self.peaks[server], self.in_flight[server])
        self.sent[server] += 1
        self.assigned[request] = server
        return server

    def give_back(self, server: int) -> None:
        """``server``'s request is answered (or failed, or was cancelled)."""
        self.in_flight[server] -= 1

    def room(self) -> int:
        """How many requests the batch may run at once."""
        return self.limit * len(self.in_flight)

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
