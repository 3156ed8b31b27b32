"""``generation.sync_transport: nccl`` for real: weights from the trainer's GPU into a ``lightning-ppo
serve --nccl`` server's over vLLM's NCCL weight transfer, checked by the server's own checksums.

It needs two CUDA devices (NCCL refuses two ranks of one group on one device: the server runs on
the second, the trainer on the first) and vLLM with CUDA in this environment (``nccl_refusal``);
elsewhere it is skipped, saying which is missing. The protocol itself is tested on any machine
against fake servers (tests/test_nccl_sync.py). Here too, on any machine: ``make gpu-check``'s
``sync`` row (``benchmarks.sync_transports``) where it cannot run is one line, not an error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_ppo import GenerationConfig
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.server import VLLMServerEngine
from lightning_ppo.rollout.engines.server.client import ServerClient
from lightning_ppo.rollout.engines.server.local_server import LocalServer
from lightning_ppo.rollout.engines.server.nccl_sync import nccl_refusal
from lightning_ppo.rollout.sampling import hf_generation_config
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _missing() -> str | None:
    """Why this machine cannot run a real NCCL sync (one line), ``None`` where it can."""
    if torch.cuda.device_count() < 2:
        return (
            f"needs 2 CUDA devices (one NCCL rank per device); this machine has {torch.cuda.device_count()}"
        )
    return nccl_refusal()  # vLLM with its weight transfer, importable here


MISSING = _missing()
needs_two_gpus_and_vllm = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 with heads of 64 (what vLLM's GPU attention kernels take)."""
    spec = TinyModelSpec(n_layer=2, n_embd=128, n_head=2)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("nccl") / "policy", spec)


@pytest.fixture(scope="module")
def nccl_server(policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """One ``serve --nccl`` server, bfloat16, on the second visible GPU; stopped at the end."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    second = visible[1] if len(visible) > 1 else "1"
    log = tmp_path_factory.mktemp("nccl-server") / "server.log"
    vllm_args = ("--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "128")
    server = LocalServer(
        policy, log, "bfloat16", vllm_args, {"CUDA_VISIBLE_DEVICES": second}, 600, serve_args=("--nccl",)
    )
    with server:
        yield server


def _moved(model: torch.nn.Module, step: int) -> None:
    """Every parameter moved (as a PPO step moves them), differently at each step."""
    generator = torch.Generator(device=model.device).manual_seed(step)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, device=parameter.device)
            parameter.add_(1e-2 * noise.to(parameter.dtype))


@needs_two_gpus_and_vllm
def test_weights_cross_from_cuda_over_nccl_and_the_server_holds_them(policy, nccl_server):
    """Two syncs over one NCCL group, each checked against the server's checksums (a sync that
    moved nothing, or the wrong tensor, is an error naming the parameter), the server's worker at
    each sync's version; the engine closed as a fit ends (the group shut down on both sides), and
    the next fit's sync opens a new group and is checked again."""
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    config = GenerationConfig(
        max_new_tokens=4,
        engine="vllm_server",
        server_urls=[nccl_server.url],
        sync_transport="nccl",
        verify_sync=True,
        server_timeout=120,
    )
    hf = hf_generation_config(config, None, tokenizer.pad_token_id)
    engine = VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    model = AutoModelForCausalLM.from_pretrained(str(policy), torch_dtype=torch.bfloat16).to("cuda:0")
    client = ServerClient(nccl_server.url, 60)
    try:
        for step in (1, 2):
            _moved(model, step)
            engine.sync_weights(model)  # raises where the server's checksums are not the sent weights'
            assert client.rpc("lppo_version") == f"{engine.tag}/{step}"
    finally:
        engine.close()  # the fit ends
    assert engine.memory is not None and not engine.memory.joined
    try:
        _moved(model, 3)
        engine.sync_weights(model)  # the next fit: a new group
        assert client.rpc("lppo_version") == f"{engine.tag}/3"
    finally:
        engine.close()


def test_the_sync_benchmark_without_a_gpu_or_vllm_is_one_skipped_line(tmp_path):
    if MISSING is None or torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark runs (make gpu-check)")
    command = [sys.executable, "-m", "benchmarks.sync_transports", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["sync transports: skipped: needs CUDA"]


def test_gpu_checks_sync_stage_without_a_gpu_is_one_skipped_row(tmp_path):
    from benchmarks import gpu_check

    lines = gpu_check.sync_transports(tmp_path, 60, "cpu")
    assert [(line.stage, line.status) for line in lines] == [("sync", "skipped")]
    assert "sync" in gpu_check.STAGE_SHARES
