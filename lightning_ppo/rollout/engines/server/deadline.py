"""One deadline for a whole HTTP exchange over the standard library (a server's checks, syncs and
worker calls: :mod:`.client`).

``urllib``'s timeout bounds each socket operation, not the call: a server that sends a byte now
and then (a proxy trickling, a worker wedged half way through its answer) holds the call as long as
it keeps doing so (``rpc('lppo_version')`` held 10.5 s at a timeout of 1 s). Here a timer shuts the
call's sockets down at its deadline, so a read blocked on one ends at once, wherever the exchange
is (sending, the status line, the headers, the body), and over TLS too. Making the connection is
counted: each address is tried with what is left of the deadline (not the whole timeout each), and
the socket is watched from the moment it connects, so a proxy's tunnel (``CONNECT``) and the TLS
handshake that follow end at the deadline too (a proxy trickling its answer to ``CONNECT`` held a
call 30 s at a timeout of 1 s). Not bounded: resolving the host's name (``getaddrinfo`` cannot be
interrupted; a literal address, as ``lightning-ppo serve`` prints, needs none).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any


class _Watch:
    """The sockets of one call, shut down once its ``timeout`` has passed (:attr:`expired`). Each
    is watched through a duplicate of its descriptor: a TLS connection takes the socket's own over
    (the object made by :meth:`connect` is left without one), and the duplicate still reaches the
    connection. The duplicates are closed by :meth:`close`, as the call ends."""

    def __init__(self, timeout: float) -> None:
        self.sockets: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + timeout
        self.timer = threading.Timer(timeout, self._expire)
        self.timer.daemon = True

    def connect(
        self, address: tuple[str, int], timeout: float | None, source: tuple[str, int] | None = None
    ) -> socket.socket:
        """``socket.create_connection``, each address tried with what is left of the deadline, the
        socket watched once connected (what follows in ``connect``: a tunnel, the TLS handshake)."""
        host, port = address
        error: OSError = TimeoutError(f"no connection to {host}:{port} within the call's deadline")
        for family, kind, protocol, _, target in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            sock = socket.socket(family, kind, protocol)
            try:
                sock.settimeout(min(left, timeout) if timeout is not None else left)
                if source:
                    sock.bind(source)
                sock.connect(target)
            except OSError as err:
                sock.close()
                error = err
                continue
            sock.settimeout(timeout)  # each read's own bound, as urllib sets it; the timer bounds the call
            self.track(sock)
            return sock
        raise error

    def track(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.append(sock.dup())
            if self.expired:
                _shut(self.sockets[-1])

    def _expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                _shut(sock)

    def close(self) -> None:
        self.timer.cancel()
        with self.lock:
            for sock in self.sockets:
                sock.close()
            self.sockets.clear()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already: the call is over
        pass


def _watched(base: type[http.client.HTTPConnection], watch: _Watch) -> Any:
    class Watched(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = watch.connect  # http.client's hook for making the socket

    return Watched


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_watched(http.client.HTTPConnection, self.watch), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_watched(http.client.HTTPSConnection, self.watch), req, context=self._context)


class DeadlinePassed(TimeoutError):
    """The exchange did not end within its deadline."""


class ErrorStatus(Exception):
    """The server answered with an error status; its body, read within the deadline too."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


def exchange(request: urllib.request.Request, timeout: float) -> bytes:
    """The body of the answer to ``request``, all of it within ``timeout`` seconds of the call:
    :class:`DeadlinePassed` once they have passed, :class:`ErrorStatus` for an error status,
    urllib's and the socket's own errors otherwise (a refused connection, an answer cut short)."""
    watch = _Watch(timeout)
    opener = urllib.request.build_opener(_HTTP(watch), _HTTPS(watch))  # the usual proxies, redirects
    watch.timer.start()
    try:
        body = _body(opener, request, timeout)
    except BaseException as err:
        if watch.expired:  # whatever the shut socket raised (a reset, a short read): the deadline
            raise DeadlinePassed(f"no answer within {timeout:g} s") from err
        raise
    finally:
        watch.close()
    if watch.expired:  # an answer without a length ends where its socket was shut: cut short
        raise DeadlinePassed(f"no answer within {timeout:g} s")
    return body


def _body(opener: urllib.request.OpenerDirector, request: urllib.request.Request, timeout: float) -> bytes:
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        with err:
            raise ErrorStatus(err.code, err.read()) from None
