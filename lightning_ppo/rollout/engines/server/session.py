"""One generation server's pooled connections, for a batch's completions (:mod:`.batch`).

Every request of a batch to one server goes through one aiohttp session on the engine's event
loop (:mod:`.connections`): keep-alive connections, at most the in-flight cap of them,
where each request had a socket and an OS thread of its own. What goes wrong is said word for
word as :class:`~.client.ServerClient` says it, naming the server's URL and route once.

The trainer's CPU per request is what a batch of a thousand costs on one loaded core: the key is
read once a batch (:meth:`ServerSession.new_batch`; it was a key file's lookup per request where
none exists), and a kept-alive connection is told apart by the connector (:class:`_NotingReuse`),
not by an aiohttp trace, which built its objects and fired its signals at every step of every
request (docs/servers.md, *Routing over several servers*: the CPU per batch).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import urllib.request
import weakref
from typing import Any
from urllib.parse import urlparse

import aiohttp

from lightning_ppo.rollout.engines.server.client import (
    ServerClient,
    broke_off,
    no_answer,
    unreachable,
)

# vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), counted from its
# answer, which a loaded trainer reads later: the session lets go of one well before, so that few
# requests go out on a connection the server is closing (those that do are sent again: _exchange).
KEEP_ALIVE_S = 2.0
# An answer cut short, or not HTTP: the standard library's IncompleteRead, RemoteDisconnected or
# BadStatusLine (aiohttp says a malformed answer with a ClientResponseError; no status is raised).
BROKEN = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)


class ServerSession:
    """The pooled connections to ``client``'s server, at most ``limit`` of them; made on the loop at
    the first request (aiohttp binds a session to the loop it is made on)."""

    def __init__(self, client: ServerClient, limit: int) -> None:
        self.client = client
        self.limit = limit
        self.session: aiohttp.ClientSession | None = None
        self.proxy = _proxy(client.url)
        self.key: str | None = None  # the batch's bearer token (new_batch)
        self.key_read = False
        self.limits: dict[float, aiohttp.ClientTimeout] = {}  # a socket's silence: its limits

    def new_batch(self) -> None:
        """The server's key (:meth:`~.client.ServerClient.key`: ``VLLM_API_KEY``, else its key file)
        is read again at the next request, for the batch about to go out: once a batch, not once a
        request; a request refused with 401 reads it again (:meth:`post`)."""
        self.key_read = False

    async def post(self, route: str, body: dict[str, Any] | bytes, timeout: float) -> Any:
        """The JSON answer to ``body`` (or its JSON, encoded) at ``route``; ``timeout``: how long the
        socket may stay silent (a completion waits behind its batch's others: the batch is bounded
        as a whole)."""
        if not self.key_read:
            self.key, self.key_read = self.client.key().value, True
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = self.key
        status, answer = await self._call(route, data, timeout, sent)
        if status == 401 and self.client.key_changed(sent):  # a server restarted here: its new key
            self.key = self.client.key().value  # the batch's next requests carry it too
            status, answer = await self._call(route, data, timeout, self.key)
        if status >= 400:
            raise self.client.error(route, self.client.refused(status, answer))
        return self.client.answer(route, answer)

    async def _call(self, route: str, data: bytes, timeout: float, key: str | None) -> tuple[int, bytes]:
        """One call's status and body (``key``: its bearer token), what went wrong on the way said as
        the client says it."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        limits = self.limits.get(timeout)
        if limits is None:  # one per timeout: a batch's requests share theirs
            limits = aiohttp.ClientTimeout(total=None, sock_connect=self.client.timeout, sock_read=timeout)
            self.limits = {timeout: limits}
        try:
            return await self._exchange(self.client.url + route, data, headers, limits)
        except aiohttp.ConnectionTimeoutError:
            raise self.client.error(route, no_answer(self.client.timeout)) from None
        except asyncio.TimeoutError:  # the socket silent for ``timeout`` (aiohttp's SocketTimeoutError)
            raise self.client.error(route, no_answer(timeout)) from None
        except aiohttp.ClientConnectorError as err:
            raise self.client.error(route, unreachable(_as_the_library_says(err.os_error))) from None
        except BROKEN as err:
            raise self.client.error(route, broke_off(err)) from None
        except (aiohttp.ClientError, OSError) as err:  # reset mid-call
            raise self.client.error(route, unreachable(err)) from None

    async def _exchange(
        self, url: str, data: bytes, headers: dict[str, str], limits: aiohttp.ClientTimeout
    ) -> tuple[int, bytes]:
        """One call's status and body. Sent again where it went out on a kept-alive connection that
        closed before any answer began: the server's keep-alive timer runs from its own last
        answer, so a loaded server closes connections that are younger here (the server did not
        read that request; it would sample it again alike, from its seed). Each such try drops one
        kept-alive connection, so there are at most as many as the pool holds; a new connection
        that closes without an answer is an error at once."""
        tries = 0
        while True:
            reused: list[bool] = []  # noted by the connector (_NotingReuse), in this task
            REUSED.set(reused)
            try:
                response = await self._session().post(
                    url, data=data, headers=headers, timeout=limits, proxy=self.proxy
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                tries += 1
                if not reused or tries > self.limit:
                    raise
                continue
            async with response:
                return response.status, await response.read()

    async def close(self) -> None:
        """Closes every connection (those of requests still out too)."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            connector = _NotingReuse(limit=self.limit, keepalive_timeout=KEEP_ALIVE_S)
            unbounded = aiohttp.ClientTimeout(total=None)  # each call says its own limits
            self.session = aiohttp.ClientSession(connector=connector, timeout=unbounded)
        return self.session


def _as_the_library_says(err: OSError) -> OSError:
    """``err`` worded as the standard library words it ("[Errno 111] Connection refused"): asyncio
    puts the address in a refused connection's message instead. A lookup's error stays as it is."""
    if isinstance(err.errno, int) and err.errno > 0:
        return OSError(err.errno, os.strerror(err.errno))
    return err


def _proxy(url: str) -> str | None:
    """The proxy the standard library's calls to ``url`` go through (``http_proxy`` unless
    ``no_proxy`` names the host), looked up once (aiohttp's own lookup, ``trust_env``, costs a
    thread hop per request and reads ``~/.netrc``, whose credentials would clash with the key)."""
    parts = urlparse(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


# Where a request notes that it went out on a kept-alive connection (a list: :class:`_NotingReuse`
# appends to it). Set by the request's own task: aiohttp's connect runs in the caller's task.
REUSED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("lppo_reused", default=None)


class _NotingReuse(aiohttp.TCPConnector):
    """A connector that notes in :data:`REUSED` each connection it hands out a second time or more
    (taken from its pool of kept-alive ones): the connections it handed out are known by identity,
    at most ``limit`` of them alive at once."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.handed: weakref.WeakSet[Any] = weakref.WeakSet()

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        if protocol in self.handed:
            noted = REUSED.get()
            if noted is not None:
                noted.append(True)
        elif protocol is not None:
            self.handed.add(protocol)
        return connection
