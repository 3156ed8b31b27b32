"""One generation server's pooled connections, for a batch's completions (:mod:`.batch`).

Every request of a batch to one server goes through one aiohttp session on the engine's event
loop (:mod:`.connections`): keep-alive connections, at most the in-flight cap of them,
where each request had a socket and an OS thread of its own. What goes wrong is said word for
word as :class:`~.client.ServerClient` says it, naming the server's URL and route once.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
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

    async def post(self, route: str, body: dict[str, Any], timeout: float) -> Any:
        """The JSON answer to ``body`` at ``route``; ``timeout``: how long the socket may stay silent
        (a completion waits behind its batch's others: the batch is bounded as a whole)."""
        sent = self.client.key().value
        status, answer = await self._call(route, body, timeout, sent)
        if status == 401 and self.client.key_changed(sent):  # a server restarted here: its new key
            status, answer = await self._call(route, body, timeout, self.client.key().value)
        if status >= 400:
            raise self.client.error(route, self.client.refused(status, answer))
        return self.client.answer(route, answer)

    async def _call(
        self, route: str, body: dict[str, Any], timeout: float, key: str | None
    ) -> tuple[int, bytes]:
        """One call's status and body (``key``: its bearer token), what went wrong on the way said as
        the client says it."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        limits = aiohttp.ClientTimeout(total=None, sock_connect=self.client.timeout, sock_read=timeout)
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
            reused: list[bool] = []  # noted by the session's trace (_noting_reuse)
            try:
                response = await self._session().post(
                    url,
                    data=data,
                    headers=headers,
                    timeout=limits,
                    proxy=self.proxy,
                    trace_request_ctx=reused,
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
            connector = aiohttp.TCPConnector(limit=self.limit, keepalive_timeout=KEEP_ALIVE_S)
            unbounded = aiohttp.ClientTimeout(total=None)  # each call says its own limits
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=unbounded, trace_configs=[_noting_reuse()]
            )
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


def _noting_reuse() -> aiohttp.TraceConfig:
    """Notes in a request's ``trace_request_ctx`` (a list) that it went out on a kept-alive connection."""

    async def reused(session: Any, context: Any, params: Any) -> None:
        context.trace_request_ctx.append(True)

    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(reused)
    return config
