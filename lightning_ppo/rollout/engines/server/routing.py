"""Which server each request of a batch goes to: the one with the fewest of this rank's requests in
flight, below a limit per server.

A request is routed as it is sent, not when the batch is made: a server that answers slowly keeps
its requests longer, so it has fewer slots free and is sent fewer, and the others take the rest
(verl's ``AsyncLLMServerManager`` picks the server it has sent the fewest requests so far, a count
that never goes down as they are answered: even servers get even shares, a slow one too). A
server whose requests all wait behind its batch is full at the limit (``generation.
server_max_in_flight``, shared by the ranks: :func:`rank_shares`); a batch runs at most its
share of each server at once, so one that fits in every server's room goes out in one wave.

Everything here runs on the engine's event loop (:mod:`.connections`), one batch at a time: no lock.
"""

from __future__ import annotations


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


class Router:
    """Hands each request of a batch a server, at most ``limits[server]`` in flight on each.

    Ties go to the server first after ``first`` (the rank: each rank starts its batch on another
    server, so a few requests from every rank do not all land on server 0)."""

    def __init__(self, limits: list[int], first: int = 0) -> None:
        servers = len(limits)
        self.limits = limits
        self.first = first % servers
        self.in_flight = [0] * servers
        self.peaks = [0] * servers
        self.sent = [0] * servers
        self.assigned: dict[int, int] = {}  # a request's index in the batch: its server

    def take(self, request: int) -> int:
        """The server for ``request``, counted in flight there until :meth:`give_back`. The batch
        runs at most every server's limit together (:meth:`room`), so one has room."""
        servers = len(self.in_flight)
        order = [(self.first + step) % servers for step in range(servers)]
        free = [index for index in order if self.in_flight[index] < self.limits[index]]
        if not free:
            raise RuntimeError(f"no server has room for request {request}: {self.in_flight} in flight")
        server = min(free, key=lambda index: self.in_flight[index])
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
