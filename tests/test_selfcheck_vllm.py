"""``lightning-ppo selfcheck`` with the vLLM engines (``make test-vllm``): the colocated engine, and a
``lightning-ppo serve`` server on 127.0.0.1, synchronous and one step off (``ppo.max_staleness: 1``).
Skipped where vllm is not importable (the main environment)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from lightning_ppo.rollout.engines.server.local_server import LocalServer  # noqa: E402
from lightning_ppo.selfcheck import SelfcheckTask, selfcheck  # noqa: E402

ENGINE = "--model.init_args.generation.engine"


def test_the_colocated_vllm_engine_lands_on_the_optimum(tmp_path):
    memory = ("--model.init_args.generation.gpu_memory_utilization", "0.05")  # on CPU: the KV cache
    result = selfcheck(tmp_path / "run", ENGINE, "vllm", *memory, draw=False)
    assert result.passed, "\n".join(result.lines())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The selfcheck's folder with its policy built, and a fp32 server of that policy."""
    out = tmp_path_factory.mktemp("selfcheck")
    policy = SelfcheckTask().checkpoint(out)
    server = LocalServer(policy, out / "server.log", dtype="float32", serve_args=("--no-api-key",))
    try:
        server.wait_ready()
        yield out, server.url
    finally:
        server.stop()


@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "max_staleness 1"])
def test_a_vllm_server_lands_on_the_optimum(served, staleness):
    out, url = served
    urls = ("--model.init_args.generation.server_urls", json.dumps([url]))
    ahead = ("--model.init_args.ppo.max_staleness", str(staleness))
    result = selfcheck(out, ENGINE, "vllm_server", *urls, *ahead, draw=False)
    assert result.passed, "\n".join(result.lines())
