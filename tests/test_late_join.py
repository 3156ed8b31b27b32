"""A stopped join's ``lppo_join`` call that reaches a server after the next join: the sibling of
test_server_failures' late receive. Fake servers on 127.0.0.1 running the real worker extension
(tests/test_server_failures.py's), stopped by the test."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_ppo.rollout.engines.server import memory_sync, worker_extension
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.memory_sync import MemorySync
from tests.test_server_failures import _eventually, _model, _served, _Serving, _synced, _weights, _Worker


class _LateJoin(_Serving):
    """A server whose first ``lppo_join`` call reaches it only once the next sync's receive is on its
    way (the stopped join's call: its thread not yet scheduled, a slow network), and runs before
    that receive; what it was answered is kept in ``late``."""

    joins: list[dict]
    receiving: threading.Event  # the next sync's receive is on its way
    late_ran: threading.Event
    late: list[int]

    def arrive(self, request: dict) -> None:
        if request["method"] == "lppo_join":
            self.joins.append(request)
            self.is_late = len(self.joins) == 1
            if self.is_late:
                self.receiving.wait(30)
        elif request["method"] == "lppo_receive":
            self.receiving.set()
            self.late_ran.wait(30)

    def reply(self, body: bytes, status: int = 200) -> None:
        if getattr(self, "is_late", False):
            self.late.append(status)
            self.late_ran.set()
        super().reply(body, status=status)


def test_a_stopped_joins_late_join_call_leaves_the_next_syncs_group_held(monkeypatch):
    """The first join ended (its timeout) with its call still on its way; the call reached the
    server after the next join, and the worker let go of the group it held for the next sync (before
    finding rank 0's old store gone): that sync's receive met a worker holding no group, and the
    sync failed with 'this server holds no weights group'. A join to a store no longer served now
    leaves the group held as it is."""
    monkeypatch.setattr(worker_extension, "_repack_embedding_gemms", lambda model: None)
    workers = [_Worker(_model())]
    attrs = {"joins": [], "receiving": threading.Event(), "late_ran": threading.Event(), "late": []}
    late = type("LateJoin", (_LateJoin,), attrs)
    with _served(workers, late) as url:
        stopped = MemorySync([ServerClient(url, 1.0)], [1], "127.0.0.1", 1.0)
        with pytest.raises(GenerationServerError):
            stopped.load(iter(_weights(_model(), 3.0)), torch.float32, True, "run/1")
        _synced(MemorySync([ServerClient(url, 20.0)], [1], "127.0.0.1", 20.0), workers, "run/2")
        assert _eventually(lambda: late.late == [500])
        assert workers[0].lppo_group() != ""


class _InterruptedAsTheCallsStart(memory_sync.Requests):
    """The calls of a sync's receive, started; Ctrl-C lands just after (before the broadcast)."""

    def __init__(self, calls, max_in_flight: int) -> None:
        super().__init__(calls, max_in_flight)
        if calls and calls[0].args[0] == "lppo_receive":
            raise KeyboardInterrupt


def test_ctrl_c_as_a_syncs_receive_calls_start_lets_the_group_go(monkeypatch):
    """Ctrl-C as the receive calls had started, before the broadcast: the group was kept, so the next
    sync (a notebook's next fit, on the same engine) sent on it; the stopped sync's call, for the
    same group, took those weights for its own, and the next sync's call waited for weights already
    taken: no answer within the server's timeout. The group is let go as for a Ctrl-C in the
    broadcast, and the next sync joins anew."""
    monkeypatch.setattr(worker_extension, "_repack_embedding_gemms", lambda model: None)
    workers = [_Worker(_model())]
    with _served(workers) as url:
        sync = MemorySync([ServerClient(url, 5.0)], [1], "127.0.0.1", 5.0)
        with monkeypatch.context() as interrupted:
            interrupted.setattr(memory_sync, "Requests", _InterruptedAsTheCallsStart)
            with pytest.raises(KeyboardInterrupt):
                sync.load(iter(_weights(_model(), 3.0)), torch.float32, True, "run/1")
        _synced(sync, workers, "run/2")
