"""The server engine where servers fail, hang, trickle or answer nonsense (issue 50, "syncs that fail
fast and leak nothing"): an answer out of range, a call whose bytes trickle in. Fake servers on
127.0.0.1 as in tests/test_server_engine.py, stopped by each test."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.test_server_engine import SYNCED, _Backlogged, _Quiet, _server_engine


@pytest.fixture
def tiny_policy(tmp_path: Path) -> Path:
    return make_tiny_checkpoint(tmp_path / "policy", TinyModelSpec(), alphabet="0123456789=")


class _Answering(_Quiet):
    """A server whose completions answer every sample with ``tokens`` and ``logprobs`` (as JSON
    writes them: ``NaN`` included), and whose workers hold the synced weights."""

    tokens: list = [3, 4]
    logprobs: list = [-0.5, -0.25]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/collective_rpc":
            answer = {"results": [SYNCED]}
        else:
            choice = {"token_ids": self.tokens, "logprobs": {"token_logprobs": self.logprobs}}
            answer = {"choices": [{**choice, "index": i} for i in range(request["n"])]}
        self.reply(json.dumps(answer).encode())


@pytest.fixture
def answering() -> Iterator[tuple[str, type[_Answering]]]:
    handler = type("Answering", (_Answering,), {})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("tokens", "logprobs", "problem"),
    [
        ([3, 999999], [-0.5, -0.5], "token id 999999, not an id of the policy's vocabulary of {vocab}"),
        ([3, -1], [-0.5, -0.5], "token id -1, not an id of the policy's vocabulary of {vocab}"),
        ([3, 4.0], [-0.5, -0.5], "token id 4.0, not an id"),
        ([3, "4"], [-0.5, -0.5], "token id '4', not an id"),
        ([3, True], [-0.5, -0.5], "token id True, not an id"),
        ([3, 4], [-0.5, float("nan")], "log-prob nan for a sampled token, not a finite number <= 0"),
        ([3, 4], [-0.5, "-0.5"], "log-prob '-0.5' for a sampled token"),
        ([3, 4], [-0.5, 0.5], "log-prob 0.5 for a sampled token"),
        ([3, 4, 5, 6, 7], [-0.5] * 5, "answered 5 tokens, more than max_new_tokens 4"),
    ],
)
def test_an_answer_out_of_range_stops_the_batch_in_one_line_naming_the_server(
    answering, tiny_policy, tokens, logprobs, problem
):
    """A token id 999999 against the tiny policy's vocabulary was taken into the rollout (then an
    index error in the policy's embedding; on a GPU a device-side assert); a negative or non-integer
    id, a NaN or positive log-prob, more tokens than asked for: each is one line naming the server."""
    url, handler = answering
    handler.tokens, handler.logprobs = tokens, logprobs
    engine = _server_engine(tiny_policy, url, timeout=30)
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_policy)))
    assert engine.vocab_size == vocab < 999999
    ids = torch.tensor([[1, 2, 3]] * 2)
    try:
        with pytest.raises(GenerationServerError) as caught:
            engine.generate(ids, torch.ones_like(ids))
    finally:
        engine.close()
    assert str(caught.value).startswith(f"generation server {url} (/v1/completions): answered ")
    assert problem.format(vocab=vocab) in str(caught.value)
    assert "\n" not in str(caught.value)


class _Trickling:
    """A server on 127.0.0.1 that answers each connection one byte every 0.25 s: the status line
    and headers first (``where`` "headers") or after them, at once ("body"), for 60 s in all,
    each byte well within a socket's timeout of 1 s. Stopped with :meth:`stop`."""

    def __init__(self, where: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.25)
        self.port = self.listener.getsockname()[1]
        body = json.dumps({"results": ["x" * 200]}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        self.at_once = b"" if where == "headers" else head.encode()
        self.trickled = (head.encode() if where == "headers" else b"") + body
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)  # the request (small: one read)
                try:
                    connection.sendall(self.at_once)
                    for byte in self.trickled[:240]:
                        if self.stopped.wait(0.25):
                            return
                        connection.sendall(bytes([byte]))
                except OSError:  # the client gave up and closed: the next connection
                    continue

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)
        self.listener.close()


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_call_whose_answer_trickles_in_ends_at_its_timeout(where):
    """Every byte of the answer came within the socket's timeout, so the call waited for the whole
    trickle (``rpc('lppo_version')`` held 10.5 s at server_timeout 1; here the trickle lasts 60 s):
    now the whole exchange has one deadline, the timeout, and the error is the hung server's line.
    The bound asserted (30 s) is far from both, so a loaded machine cannot flip it."""
    server = _Trickling(where)
    try:
        client = ServerClient(f"http://127.0.0.1:{server.port}", timeout=1.0)
        start = time.monotonic()
        with pytest.raises(GenerationServerError) as caught:
            client.rpc("lppo_version")
        waited = time.monotonic() - start
    finally:
        server.stop()
    assert waited < 30
    assert str(caught.value) == (
        f"generation server http://127.0.0.1:{server.port} (/collective_rpc lppo_version): "
        "no answer within 1 s (generation.server_timeout)"
    )
