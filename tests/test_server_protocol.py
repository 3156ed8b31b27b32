"""A trainer and a server of different lightning_ppo installs (a node not upgraded, a container
image built earlier): the calls between them changed (``lppo_receive`` names its group since
protocol 2), and each sync failed with a TypeError from the server's worker. Now the first check
refuses the server in one line naming both protocols. A fake server on 127.0.0.1 runs the real
worker extension around the tiny policy, as tests/test_let_go_at_exit.py's does, stopped by the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.worker_extension import PROTOCOL
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.test_let_go_at_exit import _Described, _Server
from tests.test_server_engine import _server_engine
from tests.test_server_failures import _served


class _Older(_Described):
    """A worker of an install from before the protocol was numbered: its description has none."""

    def lppo_describe(self) -> dict[str, Any]:
        described = super().lppo_describe()
        del described["protocol"]
        return described


@pytest.mark.parametrize("kind", ["older", "same"])
def test_a_server_of_another_protocol_is_refused_in_one_line_before_any_sync(tmp_path: Path, kind: str):
    policy = make_tiny_checkpoint(tmp_path / "policy", TinyModelSpec(), alphabet="0123456789=")
    model = AutoModelForCausalLM.from_pretrained(str(policy))
    worker = (_Older if kind == "older" else _Described)(model, policy)
    server = type("Server", (_Server,), {"tokenizer": AutoTokenizer.from_pretrained(str(policy))})
    with _served([worker], server) as url:
        engine = _server_engine(policy, url, timeout=30)
        if kind == "same":
            assert engine._check_server(ServerClient(url, 30.0), model)["protocol"] == PROTOCOL == 2
            return
        with pytest.raises(GenerationServerError) as caught:
            engine._check_server(ServerClient(url, 30.0), model)
    assert str(caught.value) == (
        f"generation server {url} (worker extension): speaks protocol 1 of lightning_ppo's calls, "
        "this trainer speaks 2: start the server with `lightning-ppo serve` from the trainer's "
        "lightning_ppo version"
    )
