"""One call of the server client (:mod:`lightning_ppo.rollout.engines.server.client`): what its
error says when a server's answer runs over many lines, and its one deadline, which counts the
connection (TCP and TLS) too. Fake servers on 127.0.0.1, each stopped by its test; every wait
bounded."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient


class _Failing(http.server.BaseHTTPRequestHandler):
    """Answers every call with HTTP 500 and ``body`` (what a proxy or a crashed server sends)."""

    body = b""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(500)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def failing() -> Iterator[type[_Failing]]:
    handler = type("Failing", (_Failing,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "vllm/worker.py", line 12, in load\n'
    "    model.load_weights(weights)\n"
    "RuntimeError: CUDA error: an illegal memory access\n"
)
HTML = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\n\t<h1>Bad  Gateway</h1>\n" + (
    "<p>" + "x" * 2000 + "</p></body></html>"
)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            json.dumps({"error": {"message": TRACEBACK, "code": 500}}).encode(),
            'Traceback (most recent call last): File "vllm/worker.py", line 12, in load '
            "model.load_weights(weights) RuntimeError: CUDA error: an illegal memory access",
        ),
        (
            b'{"detail": "line one\\n\\n  line two"}',
            "line one line two",
        ),
        (TRACEBACK.encode(), " ".join(TRACEBACK.split())),
    ],
    ids=["vllm-error-message", "detail", "plain-text"],
)
def test_a_servers_message_over_several_lines_is_said_on_one(failing, body, said):
    failing.body = body
    with pytest.raises(GenerationServerError) as raised:
        ServerClient(failing.url, timeout=10).post("/collective_rpc", {})
    assert str(raised.value) == f"generation server {failing.url} (/collective_rpc): HTTP 500: {said}"


def test_a_long_page_is_cut_with_an_ellipsis_on_one_line(failing):
    failing.body = HTML.encode()
    with pytest.raises(GenerationServerError) as raised:
        ServerClient(failing.url, timeout=10).post("/collective_rpc", {})
    message = str(raised.value)
    prefix = f"generation server {failing.url} (/collective_rpc): HTTP 500: "
    said = message.removeprefix(prefix)
    assert said.startswith("<html> <head><title>502 Bad Gateway</title></head> <body> <h1>Bad Gateway</h1>")
    assert "\n" not in message and "\r" not in message and "\t" not in message
    assert len(said) == 300 and said.endswith("xx…")
