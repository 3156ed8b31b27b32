"""The API key on every route of a ``lightning-ppo serve`` server, not only vLLM's ``/v1`` ones.

vLLM 0.32's own check (``--api-key`` / ``VLLM_API_KEY``) guards the paths starting ``/v1``,
``/v2``, ``/inference`` and ``/cohere`` only. The routes ``VLLM_SERVER_DEV_MODE=1`` opens, which the
weight sync needs (``/collective_rpc``, ``/reset_prefix_cache``, ``/pause``, ``/sleep``, ...), stay
open to anyone who can reach the port: ``/collective_rpc`` can load any file the server can read as
its weights. ``lightning-ppo serve`` adds this ASGI middleware (vLLM's ``--middleware``): with
``VLLM_API_KEY`` set, every route but the health checks needs it as a bearer token. ``serve`` sets
it: to the user's key, or to one it makes (:mod:`lightning_ppo.runs.server_keys`); only
``serve --no-api-key`` leaves it unset, and the server open.

Plain ASGI, no import of the web framework: it runs inside the server and is tested without one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from lightning_ppo.runs.server_keys import environment_key

OPEN_ROUTES = ("/health", "/ping")  # what a load balancer or LocalServer.wait_ready polls, key-less
Asgi = Callable[
    [dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


class GuardEveryRoute:
    """Refuses (401) any request without ``Authorization: Bearer $VLLM_API_KEY``, except
    :data:`OPEN_ROUTES` and CORS preflights; lets everything through where the variable is unset."""

    def __init__(self, app: Asgi) -> None:
        self.app = app
        key = environment_key()
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.digest is None or scope["type"] not in ("http", "websocket") or self._open(scope):
            await self.app(scope, receive, send)
        elif self._authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = b'{"error": "Unauthorized: this server needs its API key (VLLM_API_KEY)"}'
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _open(scope: dict[str, Any]) -> bool:
        """The health checks, and CORS preflights (an OPTIONS with both preflight headers: a plain
        OPTIONS would reach routes that ignore the method, ``/metrics``)."""
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        headers = dict(scope.get("headers") or [])
        preflight = b"origin" in headers and b"access-control-request-method" in headers
        return path in OPEN_ROUTES or (scope.get("method") == "OPTIONS" and preflight)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest or b"")
