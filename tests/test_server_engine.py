"""The ``vllm_server`` engine's parts that need no vLLM: the checksum comparison, the weights file,
the bounded HTTP calls, the settings and ``lightning-ppo serve``'s command line. The engine against
real servers is tests/test_vllm_server.py (``make test-vllm``)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.rollout.engines.server_client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server_sync import checksum, combine_workers, mismatch, write_weights
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.serve import EXTENSION, server_command
from tests.helpers import prompt_data, quiet_trainer


def _held(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """What a server's worker reports for these parameters (server_worker.checksums)."""
    return {name: [*checksum(t), float(t.numel())] for name, t in tensors.items()}


def test_checksums_match_across_fusing_transposing_and_padding():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    conv = torch.randn(4, 12)  # GPT-2's Conv1D: (in, out); vLLM holds (out, in)
    embed = torch.randn(11, 4)
    written = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "h.0.attn.c_attn.weight": conv,
        "embed.weight": embed,
    }
    held = _held(
        {
            "model.layers.0.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
            "h.0.attn.c_attn.weight": conv.T.contiguous(),
            "embed.weight": torch.cat([embed, torch.zeros(5, 4)]),  # vocabulary padded to 16
        }
    )
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    sums = {name: checksum(t) for name, t in written.items()}
    assert mismatch(sums, held, packed) is None


def test_a_sync_that_moved_nothing_or_the_wrong_tensor_names_the_parameter():
    torch.manual_seed(0)
    old = {"a.weight": torch.randn(8, 8), "b.weight": torch.randn(8, 8)}
    new = {name: t + 1e-4 * torch.randn_like(t) for name, t in old.items()}  # one small PPO step
    sums = {name: checksum(t) for name, t in new.items()}
    assert mismatch(sums, _held(new), {}) is None
    problem = mismatch(sums, _held(old), {})  # the server kept the old weights
    assert problem is not None and problem.startswith("parameter 'a.weight' holds sum"), problem
    swapped = mismatch(sums, _held({"a.weight": new["b.weight"], "b.weight": new["a.weight"]}), {})
    assert swapped is not None and "'a.weight'" in swapped
    assert "no parameter for 'b.weight'" in mismatch(sums, _held({"a.weight": new["a.weight"]}), {})
    assert "none of its 1 parameters" in mismatch(sums, _held({"other.weight": new["a.weight"]}), {})


def test_one_weight_moved_by_a_millionth_is_seen():
    torch.manual_seed(0)
    weight = torch.randn(256, 256)
    moved = weight.clone()
    moved[17, 3] *= 1 + 1e-6
    assert mismatch({"w": checksum(moved)}, _held({"w": weight}), {}) is not None


def test_weights_are_written_whole_in_the_servers_dtype(tmp_path):
    weights = [("a", torch.randn(3, 3)), ("b", torch.randn(2))]
    written = write_weights(iter(weights), tmp_path / "sync", torch.bfloat16)
    assert [p.name for p in (tmp_path / "sync").iterdir()] == [written.path.name]  # no partial file left
    loaded = load_file(written.path)
    assert {k: v.dtype for k, v in loaded.items()} == {"a": torch.bfloat16, "b": torch.bfloat16}
    assert torch.equal(loaded["a"], weights[0][1].bfloat16())
    assert written.checksums["a"] == checksum(weights[0][1].bfloat16())
    assert written.bytes == 2 * (9 + 2)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A socket on 127.0.0.1 that accepts connections and never answers (a hung server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_hung_server_is_one_error_naming_it_within_the_timeout(silent_port):
    client = ServerClient(f"http://127.0.0.1:{silent_port}", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as caught:
        client.post("/v1/completions", {"prompt": [1]})
    assert time.monotonic() - start < 5
    assert str(caught.value) == (
        f"generation server http://127.0.0.1:{silent_port} (/v1/completions): "
        "no answer within 0.5 s (generation.server_timeout)"
    )


def test_a_server_that_is_down_is_one_error_naming_it():
    port = _closed_port()
    with pytest.raises(
        GenerationServerError, match=rf"generation server http://127.0.0.1:{port} \(/health\): unreachable"
    ):
        ServerClient(f"http://127.0.0.1:{port}", timeout=5).get("/health")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every POST as vLLM answers a failed call."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"error": {"message": "Worker failed with error \'no method lppo_load\'", "code": 500}}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_an_error_status_carries_the_servers_message():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = ServerClient(f"http://127.0.0.1:{server.server_port}", timeout=5)
        with pytest.raises(
            GenerationServerError, match=r"HTTP 500: Worker failed with error 'no method lppo_load'"
        ):
            client.rpc("lppo_load", "/tmp/x")
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_against_a_server_that_is_down_stops_before_the_first_rollout(tmp_path, tiny_policy):
    port = _closed_port()
    generation = GenerationConfig(
        max_new_tokens=4, engine="vllm_server", server_urls=[f"http://127.0.0.1:{port}"]
    )
    module = PPOLightningModule(
        policy=str(tiny_policy),
        reward_fn=lambda p, c, b: [1.0] * len(c),
        ppo=PPOConfig(),
        generation=generation,
    )
    with pytest.raises(
        GenerationServerError, match=rf"http://127.0.0.1:{port} \(/collective_rpc lppo_describe\)"
    ):
        quiet_trainer(tmp_path, iterations=1).fit(module, prompt_data())


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"engine": "vllm_server"}, "generation.server_urls must be one URL or more"),
        (
            {"engine": "vllm_server", "server_urls": ["127.0.0.1:8000"]},
            "generation.server_urls must be URLs like",
        ),
        (
            {"engine": "vllm_server", "server_urls": ["http://h:1"], "server_timeout": 0},
            "generation.server_timeout",
        ),
    ],
)
def test_server_settings_are_checked(settings, field):
    with pytest.raises(UsageError, match=field):
        GenerationConfig(**settings)


def test_serve_runs_vllms_own_server_with_the_flags_the_engine_needs(tmp_path):
    command = server_command(str(tmp_path), "127.0.0.1", 8123, "bfloat16", ["--tensor-parallel-size", "2"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for flag in (
        "--generation-config vllm",
        "--logprobs-mode processed_logprobs",
        f"--worker-extension-cls {EXTENSION}",
    ):
        assert flag in joined
    assert command[-2:] == ["--tensor-parallel-size", "2"]
    with pytest.raises(UsageError, match="sets --logprobs-mode processed_logprobs itself"):
        server_command(str(tmp_path), "127.0.0.1", 8123, "auto", ["--logprobs-mode=raw_logprobs"])


def test_serve_command_line(tmp_path):
    """The console script, as a user types it: the command it would run, and a missing folder."""
    run = [sys.executable, "-m", "lightning_ppo.console", "serve"]
    printed = subprocess.run(
        run + ["--policy", str(tmp_path), "--print-command"], capture_output=True, text=True
    )
    assert printed.returncode == 0, printed.stderr
    assert (
        printed.stdout.startswith("VLLM_SERVER_DEV_MODE=1 ") and "--model " + str(tmp_path) in printed.stdout
    )
    missing = subprocess.run(run + ["--policy", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert (
        missing.stderr.strip()
        == f"lightning-ppo serve: error: lightning-ppo serve --policy: no folder {tmp_path / 'nope'}"
    )


@pytest.fixture
def tiny_policy(tmp_path: Path) -> Path:
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path / "policy", TinyModelSpec(), alphabet="0123456789=")


def test_a_tensor_parallel_servers_workers_add_up_to_the_whole_tensors():
    """Two TP workers: a column-parallel weight split in halves, a norm replicated on both."""
    torch.manual_seed(0)
    weight, norm = torch.randn(8, 4), torch.randn(4)
    workers = [_held({"w": half, "norm": norm}) for half in weight.chunk(2)]
    combined = combine_workers(workers)
    assert combined["norm"] == workers[0]["norm"]  # counted once
    assert mismatch({"w": checksum(weight), "norm": checksum(norm)}, combined, {}) is None
    assert (
        mismatch({"w": checksum(weight), "norm": checksum(norm)}, workers[0], {}) is not None
    )  # one shard is not the whole
