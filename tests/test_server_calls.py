"""One call of the server client (:mod:`lightning_ppo.rollout.engines.server.client`): what its
error says when a server's answer runs over many lines, and its one deadline, which counts the
connection (TCP and TLS) too. Fake servers on 127.0.0.1, each stopped by its test; every wait
bounded."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
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


class _TricklingProxy:
    """An HTTP proxy on 127.0.0.1 that answers each ``CONNECT`` (the tunnel of an https call) with
    its status line and then a header one byte every 0.25 s, 30 s in all: each byte well within a
    socket's timeout of 1 s, and the tunnel never open. Stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.25)
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        header = b"X-Slow: " + b"x" * 110
        while not self.stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            with connection:
                try:
                    connection.recv(65536)  # the CONNECT request (small: one read)
                    connection.sendall(b"HTTP/1.1 200 Connection established\r\n")
                    for byte in header:
                        if self.stopped.wait(0.25):
                            return
                        connection.sendall(bytes([byte]))
                except OSError:  # the client gave up and closed: the next connection
                    continue

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)
        self.listener.close()


def test_a_tunnel_that_trickles_ends_at_the_calls_timeout(monkeypatch):
    """Making the connection is part of the call: an https call through a proxy whose answer to
    ``CONNECT`` trickles was held as long as it trickled (30 s here at server_timeout 1), the
    deadline's watch only beginning once the connection (TCP, the tunnel, TLS) was made. The bound
    asserted (15 s) is far from both, so a loaded machine cannot flip it."""
    proxy = _TricklingProxy()
    for name in ("https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    try:
        client = ServerClient("https://127.0.0.1:9", timeout=1.0)  # never reached: the tunnel hangs
        start = time.monotonic()
        with pytest.raises(GenerationServerError) as caught:
            client.rpc("lppo_version")
        waited = time.monotonic() - start
    finally:
        proxy.stop()
    assert waited < 15
    assert str(caught.value) == (
        "generation server https://127.0.0.1:9 (/collective_rpc lppo_version): "
        "no answer within 1 s (generation.server_timeout)"
    )


@pytest.fixture
def never_accepting() -> Iterator[int]:
    """A port on 127.0.0.1 whose listen backlog is full: a new connection's SYN is dropped, so its
    connect waits (a blackholed address, as far as the client can tell)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # more than the backlog (0: one waiting connection) holds
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_a_connection_never_accepted_ends_at_the_calls_timeout(never_accepting):
    client = ServerClient(f"http://127.0.0.1:{never_accepting}", timeout=1.0)
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as caught:
        client.post("/collective_rpc", {})
    assert time.monotonic() - start < 20
    assert str(caught.value) == (
        f"generation server http://127.0.0.1:{never_accepting} (/collective_rpc): "
        "no answer within 1 s (generation.server_timeout)"
    )
