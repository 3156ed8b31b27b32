"""``generation.sync_transport: nccl``: our side of vLLM's weight-transfer protocol against fake
servers that record each route and payload (the routes of vLLM 0.32's RLHF router), rank 0's
broadcasts recorded in place of NCCL (which needs GPUs: tests/test_gpu.py sends them for real)."""

from __future__ import annotations

import http.server
import json
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.server import VLLMServerEngine
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.nccl_sync import NcclSync, nccl_refusal
from lightning_ppo.rollout.sampling import hf_generation_config
from lightning_ppo.runs.errors import UsageError


@dataclass
class Record:
    """What one fake server was asked, in order, and how it answers."""

    calls: list[tuple[str, dict]] = field(default_factory=list)
    fail: str = ""  # a route answered with HTTP 500
    hang: str = ""  # a route never answered (until the test ends)
    release: threading.Event = field(default_factory=threading.Event)


class _Server(http.server.BaseHTTPRequestHandler):
    record: Record

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.record.calls.append((self.path, body))
        if self.path == self.record.hang:
            self.record.release.wait(60)
            return
        if self.path == self.record.fail:
            self._reply({"error": "CUDA error: an illegal memory access"}, 500)
        elif self.path == "/collective_rpc":
            self._reply({"results": [body["args"][0] if body["args"] else {}]})
        else:
            self._reply({})

    def _reply(self, answer: dict, status: int = 200) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[list[tuple[str, Record]]]:
    started = []
    for _ in range(2):
        record = Record()
        handler = type("Server", (_Server,), {"record": record})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((server, record))
    try:
        yield [(f"http://127.0.0.1:{server.server_port}", record) for server, record in started]
    finally:
        for server, record in started:
            record.release.set()
            server.shutdown()
            server.server_close()


class Recorded:
    """Rank 0's end of the group: what it was opened with, each tensor it broadcast."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int, int]] = []
        self.sent: list[torch.Tensor] = []
        self.closed = 0

    def open(self, address: str, port: int, world: int) -> None:
        self.opened.append((address, port, world))

    def send(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor.clone())

    def close(self) -> None:
        self.closed += 1


WEIGHTS = [("a.weight", torch.randn(4, 3)), ("b.bias", torch.randn(5)), ("c.weight", torch.randn(2, 2))]


def _sync(urls: list[str], broadcaster: Recorded, timeout: float = 5.0) -> NcclSync:
    clients = [ServerClient(url, timeout) for url in urls]
    return NcclSync(clients, [1, 2], "127.0.0.1", timeout, broadcaster, bucket_bytes=20)


def test_a_sync_runs_vllms_four_phases_in_order_on_every_server(servers):
    broadcaster = Recorded()
    sync = _sync([url for url, _ in servers], broadcaster)
    sync.load(iter(WEIGHTS), torch.bfloat16, verify=False, version="run/1")
    sync.load(iter(WEIGHTS), torch.bfloat16, verify=False, version="run/2")
    ((address, port, world),) = broadcaster.opened  # one group, kept between syncs
    assert (address, world) == ("127.0.0.1", 4)  # rank 0 and the servers' 1 + 2 workers
    for (_, record), first in zip(servers, [1, 2], strict=True):
        routes = [route for route, _ in record.calls]
        one_sync = ["/collective_rpc", "/start_weight_update", "/update_weights", "/update_weights"]
        one_sync += ["/finish_weight_update", "/collective_rpc"]
        assert routes == ["/init_weight_transfer_engine", *one_sync, *one_sync]
        init = record.calls[0][1]["init_info"]
        assert init == {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": first,
            "world_size": 4,
        }
        updates = [body["update_info"] for route, body in record.calls[:7] if route == "/update_weights"]
        assert updates == [  # 24 bytes fill the 20-byte bucket, then the rest (18)
            {"names": ["a.weight"], "dtype_names": ["bfloat16"], "shapes": [[4, 3]]},
            {
                "names": ["b.bias", "c.weight"],
                "dtype_names": ["bfloat16", "bfloat16"],
                "shapes": [[5], [2, 2]],
            },
        ]
        assert record.calls[1][1]["args"] == [""]  # no version while the weights move
        assert record.calls[5][1] == {"weight_version": "run/1"}
        assert record.calls[6][1]["args"] == ["run/1"] and record.calls[12][1]["args"] == ["run/2"]
        assert all(body.get("timeout") == 5.0 for route, body in record.calls if route == "/collective_rpc")
    assert [t.dtype for t in broadcaster.sent] == [torch.bfloat16] * 6
    assert torch.equal(broadcaster.sent[3], WEIGHTS[0][1].to(torch.bfloat16))


@pytest.mark.parametrize("route", ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                   "/finish_weight_update"])  # fmt: skip
def test_a_failing_phase_stops_the_sync_at_once_in_one_line_naming_it_and_the_server(servers, route):
    (first, _), (url, record) = servers
    record.fail = route
    broadcaster = Recorded()
    with pytest.raises(GenerationServerError) as raised:
        _sync([first, url], broadcaster).load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")
    phase = route.removeprefix("/")
    assert str(raised.value) == (
        f"weight sync (generation.sync_transport: nccl), phase {phase}, failed on {url}: HTTP 500: "
        "CUDA error: an illegal memory access"
    )
    assert "\n" not in str(raised.value)
    assert broadcaster.closed == 1  # the group dropped: the next sync opens another
    if route == "/update_weights":
        assert len(broadcaster.sent) <= 1  # the refusal seen before the next tensor goes


def test_a_hung_phase_is_stopped_by_the_servers_timeout_naming_it(servers):
    (first, _), (url, record) = servers
    record.hang = "/finish_weight_update"
    with pytest.raises(GenerationServerError) as raised:
        _sync([first, url], Recorded(), timeout=1.0).load(iter(WEIGHTS), torch.float32, False, "run/1")
    assert str(raised.value) == (
        f"weight sync (generation.sync_transport: nccl), phase finish_weight_update, failed on {url}: "
        "no answer within 1 s (generation.server_timeout)"
    )


def test_nccl_without_cuda_on_the_trainer_is_refused_in_one_line(tiny_gpt2):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gpt2))
    config = GenerationConfig(
        max_new_tokens=4, engine="vllm_server", server_urls=["http://127.0.0.1:9"], sync_transport="nccl"
    )
    hf = hf_generation_config(config, None, tokenizer.pad_token_id)
    with pytest.raises(UsageError) as raised:
        VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    line = "generation.sync_transport: nccl needs CUDA on the trainer (vLLM's NCCL weight transfer); "
    assert str(raised.value) == nccl_refusal() == line + "use memory or file"


def test_serve_with_nccl_opens_vllms_weight_transfer_routes(tmp_path):
    run = [
        sys.executable,
        "-m",
        "lightning_ppo.console",
        "serve",
        "--policy",
        str(tmp_path),
        "--print-command",
    ]
    printed = subprocess.run([*run, "--nccl"], capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    command = shlex.split(printed.stdout.splitlines()[0].removeprefix("VLLM_SERVER_DEV_MODE=1 "))
    flag = command.index("--weight-transfer-config")
    assert json.loads(command[flag + 1]) == {"backend": "nccl"}
    plain = subprocess.run(run, capture_output=True, text=True)
    assert "--weight-transfer-config" not in plain.stdout
