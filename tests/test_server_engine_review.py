"""The server engine where a review of its event loop, suppressed tokens and in-memory sync broke
it: a forked child that lets go of the parent's connections, a server that refuses ``logit_bias``
(speculative decoding), a ``generation.sync_address`` rank 0 cannot listen on. Fake servers as in
tests/test_server_engine.py, on 127.0.0.1, stopped by each test."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo.rollout.engines.server import session as server_session
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.memory_sync import MemorySync
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.test_server_engine import (
    _Backlogged,
    _Counting,
    _KeepAlive,
    _Quiet,
    _server_engine,
    _suppressing_engine,
)


@pytest.fixture
def tiny_policy(tmp_path: Path) -> Path:
    return make_tiny_checkpoint(tmp_path / "policy", TinyModelSpec(), alphabet="0123456789=")


@pytest.fixture
def counting() -> Iterator[_Counting]:
    """A keep-alive server answering every completion at once, counting the connections it accepts."""
    server = type("Counting", (_Counting,), {"connections": 0})(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=server.serve_forever, name="fake-server-main", daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_forked_child_that_lets_go_of_the_parents_connections_leaves_them_working(
    counting, tiny_policy, monkeypatch
):
    """A child forked after a batch shares the kernel's list of the parent loop's watched sockets
    (one epoll object across the fork). A child that closed the engine (or made connections of its
    own) dropped the parent's sessions, whose transports, closing, took the parent's pooled sockets
    off that list: the parent's next batch went out on them and never heard its answers (stalled
    for server_timeout, then failed). Now the child leaves the list alone, and the parent's next
    batch is answered on the same connections."""
    # The pool keeps its connections however long the child takes (they would expire after 4 s and
    # the parent's next batch open new ones, hiding what the child did to the old ones).
    monkeypatch.setattr(server_session, "KEEP_ALIVE_S", 600.0)
    engine = _server_engine(tiny_policy, f"http://127.0.0.1:{counting.server_address[1]}", timeout=60)
    engine.syncs, engine.max_in_flight = 0, 4  # this fake server keeps no weights version
    ids = torch.tensor([[1, 2, i] for i in range(4)])
    assert engine.generate(ids, torch.ones_like(ids)).response_ids.shape == (4, 2)
    opened = counting.connections  # kept alive in the parent's pool
    for _ in range(3):  # the batch's last callbacks run: no task of it holds a session in the child
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), engine._connections.loop).result(30)
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's status says how it went)
        status = 1
        try:
            engine.close()  # as a child's fit ends, or its first batch makes its own
            gc.collect()  # the parent's sessions, dropped, are collected here
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        assert engine.generate(ids, torch.ones_like(ids)).response_ids.shape == (4, 2)
        assert counting.connections == opened  # the parent's own connections, still usable
    finally:
        engine.close()


class _Speculative(_Quiet):
    """A vLLM server with speculative decoding: a completion request with ``logit_bias`` is refused
    with vLLM 0.32's words, one with ``allowed_token_ids`` answered. Records every request."""

    protocol_version = "HTTP/1.1"
    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        type(self).requests.append(request)
        status, answer = (
            200,
            {
                "choices": [
                    {"index": i, "token_ids": [3, 4], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                    for i in range(request.get("n", 1))
                ]
            },
        )
        if request.get("logit_bias"):
            message = "The min_p and logit_bias sampling parameters are not yet supported with speculative "
            message += "decoding."
            status, answer = 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        body = json.dumps(answer).encode()
        self.reply(body, status=status)


@pytest.fixture
def speculative() -> Iterator[tuple[str, type[_Speculative]]]:
    handler = type("Speculative", (_Speculative,), {"requests": []})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_refuses_logit_bias_is_sent_the_allowed_ids(speculative, tiny_policy):
    """Before suppressed tokens went as the smaller encoding, every request sent allowed_token_ids,
    which a server with speculative decoding applies; it refuses logit_bias (HTTP 400), and a run
    with generation.suppress_tokens against it stopped at its first batch. Now the refused request
    is sent again with allowed_token_ids, and that server gets those from then on."""
    url, handler = speculative
    engine = _suppressing_engine(tiny_policy, url, [7], len(AutoTokenizer.from_pretrained(str(tiny_policy))))
    engine.syncs = 0  # this fake server keeps no weights version
    ids = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    try:
        assert engine.generate(ids, torch.ones_like(ids)).response_ids.tolist() == [[3, 4]] * 3
        first = list(handler.requests)
        assert engine.generate(ids, torch.ones_like(ids)).response_ids.tolist() == [[3, 4]] * 3
    finally:
        engine.close()
    # The first batch's two requests went out with the bias (both may be refused: they were in flight
    # together), each refused one again exactly; the second batch's only exactly.
    refused = [request for request in first if "logit_bias" in request]
    assert 1 <= len(refused) <= 2 and len(first) == 2 + len(refused)
    second = handler.requests[len(first) :]
    assert len(second) == 2 and all("logit_bias" not in request for request in second)
    exact = [request for request in handler.requests if "allowed_token_ids" in request]
    assert all(7 not in request["allowed_token_ids"] for request in exact)
    assert sorted((r["prompt"], r["n"]) for r in second) == [([1, 2, 3], 2), ([4, 5, 6], 1)]


def test_a_sync_address_rank_zero_cannot_listen_on_is_one_line_naming_it():
    """An address not on this machine (192.0.2.1: TEST-NET-1, documentation only) was a bare
    OSError, which the sync put as 'weight sync failed: OSError ... (generation.sync_transport,
    sync_dir)': the wrong fields. It names generation.sync_address now, before any server is asked."""
    sync = MemorySync([ServerClient("http://127.0.0.1:9", 1.0)], [1], "192.0.2.1", 1.0)
    with pytest.raises(GenerationServerError) as caught:
        sync.load(iter([("w", torch.zeros(2))]), torch.float32, False, "run/1")
    message = str(caught.value)
    assert message.startswith("generation.sync_address 192.0.2.1: rank 0 cannot listen there (")
    assert "\n" not in message
