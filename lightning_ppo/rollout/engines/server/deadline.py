"""One deadline for a whole HTTP exchange over the standard library (a server's checks, syncs and
worker calls: :mod:`.client`).

``urllib``'s timeout bounds each socket operation, not the call: a server that sends a byte now
and then (a proxy trickling, a worker wedged half way through its answer) holds the call as long as
it keeps doing so (``rpc('lppo_version')`` held 10.5 s at a timeout of 1 s). Here a timer shuts the
call's sockets down at its deadline, so a read blocked on one ends at once, wherever the exchange
is (connecting, sending, the status line, the headers, the body), and over TLS too.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
import urllib.request
from typing import Any


class _Watch:
    """The sockets of one call, shut down once its ``timeout`` has passed (:attr:`expired`)."""

    def __init__(self, timeout: float) -> None:
        self.sockets: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()
        self.timer = threading.Timer(timeout, self._expire)
        self.timer.daemon = True

    def track(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already: the call is over
        pass


def _watched(base: type[http.client.HTTPConnection], watch: _Watch) -> Any:
    class Watched(base):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            super().connect()
            watch.track(self.sock)

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
        watch.timer.cancel()
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
