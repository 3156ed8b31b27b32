"""The server engine where servers fail, hang, trickle or answer nonsense (issue 50, "syncs that fail
fast and leak nothing"): an answer out of range, a call whose bytes trickle in, a load that fails
on a server, Ctrl-C during a sync, the address a server's workers give the weights group. Fake
servers on 127.0.0.1 as in tests/test_server_engine.py, stopped by each test; the in-memory sync's
servers run the real worker extension on a tiny torch model, with a stand-in for vLLM's reload."""

from __future__ import annotations

import _thread
import contextlib
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from lightning_ppo.rollout.engines.server import worker_extension
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.memory_sync import MemorySync
from lightning_ppo.rollout.engines.server.worker_extension import WeightSyncExtension
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


class _Worker(WeightSyncExtension):
    """What vLLM mixes the worker extension into, around a tiny torch model: a model runner, the
    worker's rank, and a reload that copies each tensor into the parameter of its name (vLLM's
    fails alike on a name the model lacks: a KeyError)."""

    def __init__(self, model: nn.Module, rank: int = 0) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.rank = rank

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        held = dict(self.model_runner.get_model().named_parameters())
        with torch.no_grad():
            for name, tensor in weights_iterator:
                held[name].copy_(tensor)


class _Serving(_Quiet):
    """A server's ``/collective_rpc`` route: the method run on every worker (each on a thread, as
    vLLM's workers are processes of their own), one call at a time (as vLLM's engine runs them),
    their answers, or vLLM's HTTP 500 for a failure."""

    workers: list[_Worker]
    one_at_a_time: threading.Lock

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.arrive(request)
        with self.one_at_a_time:
            self._run(request)

    def arrive(self, request: dict) -> None:
        """Where a call is on its way to the server (a thread not yet scheduled, a slow network)."""

    def _run(self, request: dict) -> None:
        results: list = [None] * len(self.workers)
        errors: list[BaseException] = []

        def run(index: int) -> None:
            try:
                results[index] = getattr(self.workers[index], request["method"])(*request["args"])
            except Exception as err:  # noqa: BLE001  (answered as vLLM answers a failed call)
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(self.workers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        if errors:
            message = f"Worker failed with error '{type(errors[0]).__name__}: {errors[0]}'"
            self.reply(json.dumps({"error": {"message": message, "code": 500}}).encode(), status=500)
        else:
            self.reply(json.dumps({"results": results}).encode())


def _model(width: int = 32, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _weights(model: nn.Module, scale: float, extra: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters times ``scale``; ``extra``: with a tensor the model lacks, third."""
    weights = [(name, param.detach() * scale) for name, param in model.named_parameters()]
    return weights[:2] + [("lm_head.extra", torch.ones(32, 32))] + weights[2:] if extra else weights


@contextlib.contextmanager
def _served(workers: list[_Worker], serving: type[_Serving] = _Serving) -> Iterator[str]:
    """``workers`` behind a ``serving`` handler on 127.0.0.1, stopped at the end; its URL."""
    handler = type("Serving", (serving,), {"workers": workers, "one_at_a_time": threading.Lock()})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_vllm(monkeypatch) -> Iterator[tuple[str, list[_Worker]]]:
    """A server of one worker (add more to the list for tensor parallelism), on 127.0.0.1."""
    monkeypatch.setattr(worker_extension, "_repack_embedding_gemms", lambda model: None)  # vLLM's CPU GEMMs
    workers = [_Worker(_model())]
    with _served(workers) as url:
        yield url, workers


def _receiving_threads(within: float = 30.0) -> list[str]:
    """The stacks of the weights' receiving threads still alive after waiting up to ``within`` s for
    them to end. A thread looks for a stop every ``weight_group.POLL_S`` s, a store call each, so it
    ends within a fraction of a second of one; 30 s is half these tests' group timeout (60 s), so a
    thread that waits out the group still fails. Looked at once more after the deadline: the list
    taken before a stall of the test process past it (a loaded machine) was returned as it was."""
    deadline = time.monotonic() + within
    while (alive := [t for t in threading.enumerate() if t.name == "lightning-ppo-weights"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    frames = sys._current_frames()
    return [f"{t!r}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for t in alive if t.ident in frames]


def _assert_no_receiving_thread() -> None:
    left = _receiving_threads()
    assert not left, "receiving threads still alive:\n" + "\n".join(left)


def _eventually(condition: Callable[[], bool], within: float = 30.0) -> bool:
    """``condition()`` holds within ``within`` s (a server's worker ends its call after rank 0 heard)."""
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _synced(sync: MemorySync, workers: list[_Worker], version: str) -> None:
    """A sync of the model's own weights times 2 arrives whole, checked, as ``version``."""
    sums, held = sync.load(iter(_weights(_model(), 2.0)), torch.float32, True, version)
    assert len(held) == 1 and sorted(held[0][0]) == sorted(sums)
    for worker in workers:
        assert worker.lppo_version() == version
        for (name, tensor), (_, param) in zip(
            _weights(_model(), 2.0), worker.model_runner.get_model().named_parameters(), strict=True
        ):
            assert torch.equal(param, tensor), name


def test_a_load_that_fails_on_a_server_stops_the_sync_at_once_and_leaks_no_thread(fake_vllm):
    """The worker's load fails on a tensor its model lacks (the third, in the first of several
    buckets): its receiving thread was left blocked on a full queue for good, holding the old group
    and two buckets, while rank 0 sent on until the group's timeout (60 s here). Now the failure
    stops the sync for every member: rank 0 raises the worker's error at once, the thread ends, and
    the next sync joins anew and arrives whole. The bound asserted (30 s) is far from the timeout."""
    url, workers = fake_vllm
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    sync.bucket_bytes = 3 * 32 * 32 * 4  # a few tensors a bucket: several buckets after the failure
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as caught:
        sync.load(iter(_weights(_model(), 2.0, extra=True)), torch.float32, True, "run/1")
    assert time.monotonic() - start < 30
    assert str(caught.value).startswith(f"generation server {url} (/collective_rpc lppo_receive): ")
    assert "KeyError: 'lm_head.extra'" in str(caught.value)
    _assert_no_receiving_thread()
    assert sync.group is None
    assert _eventually(lambda: workers[0].lppo_group() == "") and workers[0].lppo_version() == ""
    start = time.monotonic()
    _synced(sync, workers, "run/2")
    assert time.monotonic() - start < 30


def test_ctrl_c_during_a_sync_leaves_no_group_for_the_next_fit(fake_vllm):
    """Ctrl-C while rank 0 gathers the weights (KeyboardInterrupt from its weights, after 3 of 8):
    the group stayed in place, and the next fit in the notebook sent on it to workers still waiting
    for the rest of the interrupted sync (a hang until the group's timeout). Now the interrupt
    propagates as it is, the servers are told to stop, the group is let go, and the next sync joins
    anew and arrives whole."""
    url, workers = fake_vllm
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    sync.bucket_bytes = 3 * 32 * 32 * 4

    def interrupted() -> Iterator[tuple[str, torch.Tensor]]:
        for index, weight in enumerate(_weights(_model(), 3.0)):
            if index == 3:
                raise KeyboardInterrupt
            yield weight

    with pytest.raises(KeyboardInterrupt):
        sync.load(interrupted(), torch.float32, True, "run/1")
    assert sync.group is None
    _assert_no_receiving_thread()
    start = time.monotonic()
    _synced(sync, workers, "run/2")
    assert time.monotonic() - start < 30


class _LateReceive(_Serving):
    """A server whose first ``lppo_receive`` call reaches it only once the next join has started
    there (the interrupted sync's call still on its way: its thread not yet scheduled, a slow
    network); what each such late call was answered is kept in ``late``."""

    rejoined: threading.Event
    late: list[tuple[int, bytes]]

    def arrive(self, request: dict) -> None:
        if request["method"] == "lppo_join" and any(worker.lppo_group() for worker in self.workers):
            self.rejoined.set()
        elif request["method"] == "lppo_receive" and request["args"][1] == "run/1":
            self.rejoined.wait(30)
            self.is_late = True

    def reply(self, body: bytes, status: int = 200) -> None:
        if getattr(self, "is_late", False):
            self.late.append((status, body))
        super().reply(body, status=status)


def test_a_stopped_syncs_late_receive_call_is_refused_and_the_next_sync_arrives_whole(monkeypatch):
    """Ctrl-C before the first bucket went, while the sync's receive call was still on its way: it
    reached the server after the next fit's join, the worker took the next sync's weights for it,
    and the next sync's own receive waited for weights already taken (CI: no answer within 60 s, the
    server's timeout). A receive names the group it is for; a worker refuses one for another group."""
    monkeypatch.setattr(worker_extension, "_repack_embedding_gemms", lambda model: None)
    workers = [_Worker(_model())]
    late = type("LateReceive", (_LateReceive,), {"rejoined": threading.Event(), "late": []})
    with _served(workers, late) as url:
        sync = MemorySync([ServerClient(url, 20.0)], [1], "127.0.0.1", 20.0)

        def interrupted() -> Iterator[tuple[str, torch.Tensor]]:
            yield from _weights(_model(), 3.0)[:3]
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            sync.load(interrupted(), torch.float32, True, "run/1")
        _synced(sync, workers, "run/2")
        assert _eventually(lambda: len(late.late) == 1)
        status, body = late.late[0]
        assert status == 500
        assert "is for a weights group this worker no longer holds" in json.loads(body)["error"]["message"]


class _LateWorker(_Worker):
    """A server's second worker (tensor parallelism) whose join starts only once ``go`` is set (a
    slow worker, the reason a user hits Ctrl-C); as its call arrives, rank 0 is interrupted."""

    def __init__(self, model: nn.Module, go: threading.Event) -> None:
        super().__init__(model, rank=1)
        self.go = go

    def lppo_join(self, *args: str) -> int:
        if not self.go.is_set():  # the interrupted join: Ctrl-C while rank 0 waits for this worker
            threading.Timer(0.5, _thread.interrupt_main).start()
            self.go.wait(60)
        return super().lppo_join(*args)


def test_ctrl_c_during_the_join_lets_the_servers_go_and_the_next_fit_syncs(fake_vllm):
    """Ctrl-C while rank 0 waits for a slow worker to join (the other one joined, waiting in the
    group's rendezvous): the interrupted store stayed alive with the error's traceback (a notebook
    keeps it), so the joined worker waited there the whole timeout (60 s) and the slow one, told a
    port nobody serves any more, retried it as long; the server, busy with that join, held the next
    fit's join until its own timeout (JoinFailed). Now the store goes with the interrupt, each worker
    stops at once, and the next fit's sync (the same engine's) joins anew and arrives whole."""
    url, workers = fake_vllm
    go = threading.Event()
    workers.append(_LateWorker(_model(), go))
    sync = MemorySync([ServerClient(url, 60.0)], [2], "127.0.0.1", 60.0)
    with pytest.raises(KeyboardInterrupt):
        sync.load(iter(_weights(_model(), 2.0)), torch.float32, True, "run/1")
    assert sync.group is None
    go.set()  # the slow worker's join goes on now, to the interrupted group's port
    _synced(sync, workers, "run/2")
    assert [worker.lppo_group() for worker in workers] == [sync.secret] * 2


def _dual_stack_localhost(real: Callable) -> Callable:
    """``socket.getaddrinfo`` as glibc answers on a machine whose /etc/hosts maps ``localhost`` to
    ``::1`` and ``127.0.0.1`` (most distributions): the IPv6 address first. This machine's hosts
    file maps it to 127.0.0.1 alone; torch's own resolver (the store's client) still does."""

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "localhost":
            return real(host, port, *args, **kwargs)
        six = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port or 0, 0, 0))
        return [six, (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port or 0))]

    return getaddrinfo


def test_a_sync_address_named_localhost_is_one_address_for_rank_zero_and_the_servers(fake_vllm, monkeypatch):
    """``sync_address: localhost`` where it resolves to ::1 first: rank 0 listened on ::1 alone while
    the server's worker, told the name, reached 127.0.0.1 through torch's resolver (refused: the
    join failed at its timeout). The name is resolved once on the trainer, to its IPv4 address where
    it has one, and that address is what rank 0 listens on and what the servers are told."""
    from lightning_ppo.rollout.engines.server.memory_sync import sync_address

    url, workers = fake_vllm
    monkeypatch.setattr(socket, "getaddrinfo", _dual_stack_localhost(socket.getaddrinfo))
    address = sync_address("localhost", [url])
    assert address == "127.0.0.1"
    _synced(MemorySync([ServerClient(url, 5.0)], [1], address, 5.0), workers, "run/1")


def test_a_sync_address_that_does_not_resolve_is_one_line_naming_it():
    """Resolved on the trainer now (it was passed on to rank 0's bind and to every server)."""
    from lightning_ppo.rollout.engines.server.memory_sync import sync_address

    with pytest.raises(GenerationServerError) as caught:
        sync_address("no-such-host.invalid", ["http://127.0.0.1:9"])
    said = str(caught.value)
    assert said.startswith("generation.sync_address no-such-host.invalid: does not resolve here (")
    assert "\n" not in said


def _has_ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs ::1 (this machine has no IPv6 loopback)")
def test_a_sync_address_given_as_an_ipv6_literal_syncs(fake_vllm):
    """``sync_address: '::1'`` (or a name with only IPv6 addresses): rank 0's gloo device was put on
    127.0.0.1 (the loopback names were all mapped to it) while the worker gave ::1, and gloo refused
    the pair of families at once (``ss1.ss_family == ss2.ss_family. 2 vs 10``): no sync arrived."""
    from lightning_ppo.rollout.engines.server.memory_sync import sync_address

    url, workers = fake_vllm
    address = sync_address("::1", [url])
    assert address == "::1"
    sync = MemorySync([ServerClient(url, 5.0)], [1], address, 5.0)
    _synced(sync, workers, "run/1")
    assert sync.group.store.get("address/1") == b"::1"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_sync_address_is_one_line_naming_it(wildcard):
    """A wildcard is where to listen, not an address the servers can reach rank 0 at: it was told
    to them as it was (a server on another machine connects to itself there, and its worker then
    said the trainer had stopped the join)."""
    from lightning_ppo.rollout.engines.server.memory_sync import sync_address

    with pytest.raises(GenerationServerError) as caught:
        sync_address(wildcard, ["http://127.0.0.1:9"])
    said = str(caught.value)
    assert said.startswith(f"generation.sync_address {wildcard}: listens everywhere, but the servers ")
    assert "\n" not in said


def _listening_on(address_hex: str) -> int:
    """How many sockets listen on the address (hex, as /proc/net/tcp writes it)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(
        1 for line in lines if line.split()[3] == "0A" and line.split()[1].startswith(address_hex + ":")
    )


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="reads Linux's socket tables")
def test_a_servers_workers_join_the_weights_group_at_the_address_set_for_them(fake_vllm, monkeypatch):
    """``LIGHTNING_PPO_SYNC_HOST`` where the server runs (here 127.0.0.3, another loopback address):
    its workers' gloo pairs listen there, and the sync arrives whole. It was ignored: a worker gave
    the host of the server's URL, which on the server's own machine may resolve to 127.0.1.1 (Debian,
    Ubuntu: ``serve --host 0.0.0.0`` prints the node's name), unreachable from another node."""
    url, workers = fake_vllm
    monkeypatch.setenv("LIGHTNING_PPO_SYNC_HOST", "127.0.0.3")
    assert _listening_on("0300007F") == 0
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    _synced(sync, workers, "run/1")
    assert _listening_on("0300007F") >= 1
    assert sync.group.store.get("address/1") == b"127.0.0.3"


def test_without_a_setting_a_worker_gives_its_address_towards_rank_zero(fake_vllm):
    """Rank 0 at 127.0.0.1: the worker gives the address its machine reaches rank 0 from, as
    recorded in the group's store (a join that fails names it)."""
    from lightning_ppo.rollout.engines.server.weight_group import address_towards

    url, workers = fake_vllm
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    _synced(sync, workers, "run/1")
    assert sync.group.store.get("address/1").decode() == address_towards("127.0.0.1") == "127.0.0.1"


def test_a_server_address_the_group_cannot_use_is_one_line_naming_it(fake_vllm, monkeypatch):
    """A set address that is not the server's (198.51.100.7, a documentation address): the worker's
    join fails at once, and the trainer's line names the address and where it came from, not a
    timeout's bare words."""
    url, workers = fake_vllm
    monkeypatch.setenv("LIGHTNING_PPO_SYNC_HOST", "198.51.100.7")
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as caught:
        sync.load(iter(_weights(_model(), 2.0)), torch.float32, True, "run/1")
    assert time.monotonic() - start < 30
    assert str(caught.value).startswith(f"generation server {url} (/collective_rpc lppo_join): HTTP 500")
    assert "at 198.51.100.7 (LIGHTNING_PPO_SYNC_HOST)" in str(caught.value)


def test_a_join_that_times_out_names_the_address_each_worker_gave(fake_vllm):
    """Two workers expected, one there (a worker that never joins): the join ends at the group's
    timeout (3 s) with the address each member gave, and the setting that changes a server's."""
    url, _ = fake_vllm
    sync = MemorySync([ServerClient(url, 3.0)], [2], "127.0.0.1", 3.0)
    with pytest.raises(GenerationServerError) as caught:
        sync.load(iter(_weights(_model(), 2.0)), torch.float32, True, "run/1")
    assert "at 127.0.0.1" in str(caught.value) and "LIGHTNING_PPO_SYNC_HOST" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_sampling_job_left_after_a_failed_fit_does_not_open_the_connections_again(answering, tiny_policy):
    """A fit that fails leaves its sampling job running on its background thread (EndSamplingOnFailure)
    and closes the engine's connections (CloseEngine). The job's next batch (an episode's next turn)
    opened them again from its thread, unlocked against the close, and nothing closed them after. Now
    it stops there in one line; the main thread (a user's call, the next fit) opens them again."""
    from lightning_ppo.rollout.fit_callbacks import CloseEngine
    from lightning_ppo.runs.daemon_worker import DaemonWorker

    url, _ = answering
    engine = _server_engine(tiny_policy, url, timeout=30)
    ids = torch.tensor([[1, 2, 3]] * 2)
    try:
        engine.generate(ids, torch.ones_like(ids))  # a batch of the fit: the connections are open
        CloseEngine().on_exception(None, SimpleNamespace(_engine=engine), RuntimeError("the fit failed"))
        assert engine._connections is None
        left = DaemonWorker("lightning-ppo-rollouts")
        with pytest.raises(GenerationServerError, match="closed as its fit ended"):
            left.submit(lambda: engine.generate(ids, torch.ones_like(ids))).result(60)
        left.close(wait=True)
        assert engine._connections is None
        assert engine.generate(ids, torch.ones_like(ids)).response_ids.tolist() == [[3, 4], [3, 4]]
        assert engine._connections is not None
    finally:
        engine.close()


class _FailingWorker(_Worker):
    """A worker whose load fails at its 5th tensor (a device out of memory, say)."""

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        for index, _ in enumerate(weights_iterator):
            if index == 4:  # over two lines, as a server's errors often are
                raise RuntimeError("out of memory\nloading the 5th tensor")


def test_a_failing_worker_stops_its_tensor_parallel_sibling_and_the_other_servers_at_once(fake_vllm):
    """Two servers, the first with two workers (tensor parallel) whose second fails its load: its
    server answers only once both workers return, so rank 0 heard nothing until its sibling, and
    the other server's worker, had waited out the group's timeout (60 s). Now the failing worker's
    word in the store stops every member: rank 0 raises its error naming its server and worker,
    every receiving thread ends, and the next sync (every worker sound again) joins anew and
    arrives whole."""
    url, workers = fake_vllm
    big = partial(_model, 512, 16)  # 16 MB: more than the sockets hold for a worker that stopped
    workers[0] = _Worker(big())
    workers.append(_FailingWorker(big(), rank=1))
    other = [_Worker(big())]
    handler = type("Serving", (_Serving,), {"workers": other, "one_at_a_time": threading.Lock()})
    second = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=second.serve_forever, daemon=True).start()
    other_url = f"http://127.0.0.1:{second.server_port}"
    try:
        servers = [ServerClient(url, 60.0), ServerClient(other_url, 60.0)]
        sync = MemorySync(servers, [2, 1], "127.0.0.1", 60.0)
        sync.bucket_bytes = 2**20
        start = time.monotonic()
        with pytest.raises(GenerationServerError) as caught:
            sync.load(iter(_weights(big(), 2.0)), torch.float32, True, "run/1")
        assert time.monotonic() - start < 30
        assert str(caught.value).startswith(f"generation server {url} (/collective_rpc lppo_receive): ")
        assert "out of memory loading the 5th tensor" in str(caught.value)
        assert "\n" not in str(caught.value)
        _assert_no_receiving_thread()
        # the failing worker let go of the group; the others stopped too, or had loaded it all
        assert _eventually(lambda: workers[1].lppo_group() == "")
        workers[1] = _Worker(big(), rank=1)
        sums, held = sync.load(iter(_weights(big(), 2.0)), torch.float32, True, "run/2")
        assert [len(answers) for answers in held] == [2, 1]
        assert [w.lppo_version() for w in [*workers, *other]] == ["run/2"] * 3
    finally:
        second.shutdown()
        second.server_close()


def test_a_rank_zero_address_a_server_cannot_resolve_is_one_line_naming_it(fake_vllm):
    """``generation.sync_address`` given as a name the server cannot resolve: the worker's join
    says so, naming the field, instead of a bare resolver error."""
    url, workers = fake_vllm
    args = ("no-such-host.invalid", "1", "2", "1", "5", "", "secret")
    with pytest.raises(RuntimeError) as caught:
        workers[0].lppo_join(*args)
    assert str(caught.value).startswith(
        "weights group rank 1: this server finds no route to rank 0 at no-such-host.invalid "
        "(generation.sync_address): "
    )


def test_a_peer_that_stopped_the_sync_and_closed_its_pairs_is_named_not_the_closed_pipe(monkeypatch):
    """A worker says in the store why it stops the sync, then lets go of the group, which closes its
    gloo pairs. Rank 0 looks at the store between waits, but a trainer's thread that ran late (two
    test workers on two busy cores) met the closed pipe first and raised gloo's "Connection closed
    by peer" (the trainer then asked whether the servers reach rank 0's address) instead of the
    worker's reason. Here rank 0 looks at the store only every 60 s, so it always meets the closed
    pipe first: the stop said in the store is what it raises."""
    from lightning_ppo.rollout.engines.server import weight_group

    listener = weight_group.listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    joined, raised = threading.Event(), []

    def rank_zero() -> None:
        group = weight_group.open_group("127.0.0.1", port, 0, 2, 60, "127.0.0.1", listener=listener)
        joined.wait(30)
        try:  # 64 MB: more than the sockets hold for a peer that takes none of it
            weight_group.send(group, iter([("w", torch.ones(2**24))]), "run/1")
        except BaseException as err:  # noqa: BLE001  (asserted below, on the test's thread)
            raised.append(err)
        group.let_go()

    trainer = threading.Thread(target=rank_zero, daemon=True)
    trainer.start()
    peer = weight_group.open_group("127.0.0.1", port, 1, 2, 60, "127.0.0.1")
    monkeypatch.setattr(weight_group, "POLL_S", 60.0)  # the join looks every POLL_S too: after it
    joined.set()
    length = torch.zeros(1, dtype=torch.int64)  # the bucket's header length: rank 0 is past its look
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    peer.process_group.broadcast([length], options).wait()
    assert int(length) > 0
    peer.stop("run/1", "RuntimeError: out of memory\nloading the 5th tensor")
    peer.let_go()
    trainer.join(30)
    assert not trainer.is_alive()
    assert [type(err) for err in raised] == [weight_group.SyncStopped]
    assert (raised[0].rank, raised[0].why) == (1, "RuntimeError: out of memory loading the 5th tensor")


class _DyingWorker(_Worker):
    """A worker whose process dies after 4 buckets (killed for memory, say): its gloo pairs close
    with no word in the store, and its server answers the call with an error once it notices (here:
    once rank 0 met the closed pipe and said so in the store: the slowest order for the trainer)."""

    def lppo_receive(
        self, with_checksums: str = "1", version: str = "", secret: str = ""
    ) -> dict[str, list[float]] | None:
        from lightning_ppo.rollout.engines.server import weight_group

        group = self.lppo_weights_group
        store = group.store
        for _ in range(4):
            weight_group._receive_bucket(group, lambda: None)
        self._lppo_let_go()  # nothing pending: its pairs close at once, as a dead process's do
        assert _eventually(lambda: store.check([f"stop/{version}"]))
        raise RuntimeError("the worker's process died (killed: out of memory)")


def test_a_worker_that_died_mid_sync_is_named_by_its_servers_answer_not_the_closed_pipe(fake_vllm):
    """A server's worker dies during the in-memory sync: rank 0 meets its closed pipe before the
    server answers, and raised at once what the broadcast met, asking whether the servers reach
    rank 0's address (they did). Now rank 0 gives the servers a few seconds to answer and raises
    the dead worker's server's answer; the next sync (the worker sound again) joins anew."""
    url, workers = fake_vllm
    big = partial(_model, 512, 16)  # 16 MB in 1 MB buckets: rank 0 is still sending when it dies
    workers[0] = _DyingWorker(big())
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    sync.bucket_bytes = 2**20
    with pytest.raises(GenerationServerError) as caught:
        sync.load(iter(_weights(big(), 2.0)), torch.float32, True, "run/1")
    assert str(caught.value).startswith(f"generation server {url} (/collective_rpc lppo_receive): ")
    assert "RuntimeError: the worker's process died (killed: out of memory)" in str(caught.value)
    _assert_no_receiving_thread()
    workers[0] = _Worker(big())
    sums, held = sync.load(iter(_weights(big(), 2.0)), torch.float32, True, "run/2")
    assert [len(answers) for answers in held] == [1] and workers[0].lppo_version() == "run/2"


class _PipeClosedWorker(_Worker):
    """A worker whose receive, once the sync stopped, answers with gloo's closed pipe: it met rank
    0's pairs closing before it looked at the store, and the store was gone with them."""

    def lppo_receive(
        self, with_checksums: str = "1", version: str = "", secret: str = ""
    ) -> dict[str, list[float]] | None:
        try:
            return super().lppo_receive(with_checksums, version, secret)
        except Exception:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:40000") from None


def test_the_trainers_own_error_in_its_weights_is_raised_as_it_is_not_a_servers_answer(fake_vllm):
    """The trainer's weights fail part way (an error of its own gather, after 3 of 8 tensors): the
    sync stopped, and rank 0 waited up to 5 s for the servers' answers and raised one that was more
    than an echo of its stop (a worker's closed pipe) instead of its own error, or, a server slow to
    answer, its own error 5 s late, asking whether the servers reach rank 0's address. Now its own
    error is raised as it is, at once; the next sync joins anew and arrives whole."""
    url, workers = fake_vllm
    workers[0] = _PipeClosedWorker(_model())
    sync = MemorySync([ServerClient(url, 60.0)], [1], "127.0.0.1", 60.0)
    sync.bucket_bytes = 3 * 32 * 32 * 4

    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        for index, weight in enumerate(_weights(_model(), 3.0)):
            if index == 3:
                raise ValueError("the policy's gather failed on rank 0")
            yield weight

    with pytest.raises(ValueError, match="^the policy's gather failed on rank 0$"):
        sync.load(failing(), torch.float32, True, "run/1")
    assert sync.group is None
    _assert_no_receiving_thread()
    workers[0] = _Worker(_model())
    _synced(sync, workers, "run/2")
