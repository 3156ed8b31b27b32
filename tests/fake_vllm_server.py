"""What ``lightning-ppo serve`` becomes, without vLLM: an HTTP server on ``--host``/``--port`` whose
app is wrapped in the ``--middleware`` serve passes (the real key guard, in the server's process,
with the environment serve gave it). ``/health`` answers 200, ``/collective_rpc`` a weights version,
any other route ``{}``. Tests put a ``vllm.entrypoints.openai.api_server`` module that calls
:func:`main` on the server's ``PYTHONPATH`` (``tests/test_server_keys.py``)."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from aiohttp import web


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The served routes, as an ASGI app (what vLLM's FastAPI app is to the middleware)."""
    body = {"results": ["none"]} if scope["path"] == "/collective_rpc" else {}
    data = json.dumps(body).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": data})


def _handler(asgi: Any) -> Any:
    """An aiohttp handler that runs one request through ``asgi``."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in request.headers.items()
        ]
        scope = {
            "type": "http",
            "method": request.method,
            "path": request.path,
            "root_path": "",
            "headers": headers,
        }
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asgi(scope, receive, send)
        content = b"".join(message.get("body", b"") for message in sent[1:])
        return web.Response(status=sent[0]["status"], body=content, content_type="application/json")

    return handle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--middleware", action="append", default=[])
    args, _ = parser.parse_known_args()
    asgi: Any = _app
    for dotted in args.middleware:
        module, name = dotted.rsplit(".", 1)
        asgi = getattr(importlib.import_module(module), name)(asgi)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _handler(asgi))
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
