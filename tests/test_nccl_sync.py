"""``generation.sync_transport: nccl``: our side of vLLM's weight-transfer protocol against fake
servers that record each route and payload (the routes of vLLM 0.32's RLHF router), rank 0's
broadcasts recorded in place of NCCL (which needs GPUs: tests/test_nccl_gpu.py sends them for real)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.server import VLLMServerEngine
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.nccl_rendezvous import serve_rendezvous
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
    # At /init_weight_transfer_engine: another process's bind of the store's port (True: it got the
    # port), and the key "owner" read from the store there, as a worker joins it
    took_port: list[bool] = field(default_factory=list)
    join_store: bool = False
    owner: str = ""
    # At /init_weight_transfer_engine: the server's worker joins rank 0's store as vLLM's does (it
    # counts as one of the world's ranks) and waits there for NCCL's id; what ended its wait
    joins_as_worker: bool = False
    worker_ended: list[str] = field(default_factory=list)
    # vLLM 0.32's worker (gpu_worker.py): a weight update is active from /start_weight_update until
    # /finish_weight_update, or an /update_weights that fails; a start while one is active is refused
    updating: bool = False


class _Server(http.server.BaseHTTPRequestHandler):
    record: Record

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.record.calls.append((self.path, body))
        if self.path == "/init_weight_transfer_engine":
            self._rendezvous(body["init_info"])
        if self.path == self.record.hang:
            self.record.release.wait(60)
            return
        if self.path == self.record.fail:
            self.record.updating = self.record.updating and self.path != "/update_weights"
            self._reply({"error": "CUDA error: an illegal memory access"}, 500)
        elif self.path in ("/start_weight_update", "/finish_weight_update"):
            self._update(starts=self.path == "/start_weight_update")
        elif self.path == "/collective_rpc":
            self._reply({"results": [body["args"][0] if body["args"] else {}]})
        else:
            self._reply({})

    def _update(self, starts: bool) -> None:
        if starts == self.record.updating:
            said = "start_weight_update called while a weight update is already active" if starts else (
                "finish_weight_update called without a matching start_weight_update")
            self._reply({"error": said}, 500)
        else:
            self.record.updating = starts
            self._reply({})

    def _rendezvous(self, init: dict) -> None:
        address, port = init["master_address"], init["master_port"]
        with socket.socket() as other:
            try:
                other.bind((address, port))
                self.record.took_port.append(True)
            except OSError:  # EADDRINUSE: the store holds it
                self.record.took_port.append(False)
        if self.record.join_store:
            store = TCPStore(address, port, is_master=False, timeout=timedelta(seconds=30))
            self.record.owner = store.get("owner").decode()
        if self.record.joins_as_worker:  # vLLM's StatelessProcessGroup.create, then the id's get
            worker = TCPStore(address, port, init["world_size"], is_master=False,
                              timeout=timedelta(seconds=30), use_libuv=False)  # fmt: skip
            try:
                worker.get("broadcast_from/0/0")
                self.record.worker_ended.append("got the id")
            except Exception as err:  # noqa: BLE001  (rank 0's store gone: what the test looks for)
                self.record.worker_ended.append(type(err).__name__)

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
    with _serving(2) as started:
        yield started


@contextlib.contextmanager
def _serving(count: int) -> Iterator[list[tuple[str, Record]]]:
    started = []
    for _ in range(count):
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
    """Rank 0's end of the group: what it was opened with (the address and port its store's socket
    listens on, still listening), each tensor it broadcast."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int, int]] = []
        self.sent: list[torch.Tensor] = []
        self.closed = 0

    def open(self, listener: socket.socket, world: int, timeout: float, failed=lambda: None) -> None:
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)  # still listening
        address, port = listener.getsockname()[:2]
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


class Storing(Recorded):
    """Rank 0's end serving a real rendezvous store on the socket it is handed, as vLLM's
    ``StatelessProcessGroup.create(listen_socket=...)`` does, with its ``owner`` key set."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner
        self.store: TCPStore | None = None

    def open(self, listener: socket.socket, world: int, timeout: float, failed=lambda: None) -> None:
        super().open(listener, world, timeout)
        address, port = listener.getsockname()[:2]
        self.store = TCPStore(
            address,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=os.dup(listener.fileno()),
        )
        self.store.set("owner", self.owner)

    def close(self) -> None:
        super().close()
        self.store = None


def test_no_other_process_can_take_the_stores_port_between_its_choice_and_the_store(servers):
    """The port the servers are given is held by rank 0's listening socket from the moment it is
    chosen until the store serves on it. Before, it was a free port probed (bound and closed) and
    bound again by the store later: another process binding it meanwhile (here each server, as it
    is told the port) got it, and the group's rendezvous went to that process or failed."""
    broadcaster = Storing("run")
    sync = _sync([url for url, _ in servers], broadcaster)
    sync.load(iter(WEIGHTS), torch.float32, False, "run/1")
    sync.close()
    ((_, port, _),) = broadcaster.opened
    for _, record in servers:
        assert record.took_port == [False]
        assert record.calls[0][1]["init_info"]["master_port"] == port


def test_two_syncs_started_at_once_on_one_host_each_reach_their_own_store():
    """Two trainers' first syncs at once on one machine (two runs, or two notebooks): each server
    joins the store of the sync that told it its port, which serves on the socket that chose it."""
    with _serving(4) as started:
        for _, record in started:
            record.join_store = True
        broadcasters = [Storing("first"), Storing("second")]
        syncs = [
            NcclSync([ServerClient(url, 30) for url, _ in pair], [1, 1], "127.0.0.1", 30, broadcaster)
            for pair, broadcaster in zip([started[:2], started[2:]], broadcasters, strict=True)
        ]
        barrier = threading.Barrier(2, timeout=30)

        def load(sync: NcclSync) -> None:
            barrier.wait()
            sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")

        threads = [threading.Thread(target=load, args=(sync,)) for sync in syncs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        assert [record.owner for _, record in started] == ["first", "first", "second", "second"]
        assert broadcasters[0].opened[0][1] != broadcasters[1].opened[0][1]
        for sync in syncs:
            sync.close()


def _nccl_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("lppo-nccl")]


def test_the_group_is_closed_as_the_engine_closes_and_the_next_fit_opens_another(
    servers, tiny_gpt2, monkeypatch
):
    """The engine closes as each fit ends (returns or raises: CloseEngine): every server is asked to
    shut its end of the NCCL group down, rank 0 destroys its own and the calls' threads end; the next
    fit's first sync opens a new group. Before, the group (NCCL's communicator, its store's port,
    the threads) was kept after the fit for as long as the process ran."""
    from lightning_ppo.rollout.engines.server import engine as engine_module

    monkeypatch.setattr(engine_module, "nccl_refusal", lambda: None)  # this machine has no CUDA
    urls = [url for url, _ in servers]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gpt2))
    config = GenerationConfig(max_new_tokens=4, engine="vllm_server", server_urls=urls, sync_transport="nccl")
    hf = hf_generation_config(config, None, tokenizer.pad_token_id)
    engine = VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    broadcaster = Recorded()
    sync = engine._memory = NcclSync(engine.servers, [1, 2], "127.0.0.1", 5.0, broadcaster, bucket_bytes=20)
    earlier = set(_nccl_threads())  # other tests' syncs
    sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")
    assert set(_nccl_threads()) - earlier and broadcaster.closed == 0
    engine.close()  # the fit ends
    assert broadcaster.closed == 1 and not sync.joined
    for _, record in servers:
        assert record.calls[-1] == ("/shutdown_weight_transfer_engine", {})
    for _ in range(100):  # at most 10 s
        if not set(_nccl_threads()) - earlier:
            break
        time.sleep(0.1)
    assert not set(_nccl_threads()) - earlier
    sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/2")  # the next fit
    assert len(broadcaster.opened) == 2
    for _, record in servers:
        routes = [route for route, _ in record.calls]
        assert routes.count("/init_weight_transfer_engine") == 2
    engine.close()
    assert broadcaster.closed == 2


def test_a_sync_that_failed_part_way_leaves_no_server_mid_update_for_the_next(servers):
    """The second server refuses a bucket (its /update_weights fails, which ends its update); the
    first had taken it and stayed in the update the failed sync started (vLLM's worker: until
    /finish_weight_update), so every later sync's /start_weight_update was refused there ("already
    active") until the server restarted. Now the next sync finishes what the failed one left open
    first (after the version is cleared: nothing says these weights are a version) and arrives."""
    (first, first_record), (url, record) = servers
    record.fail = "/update_weights"
    broadcaster = Recorded()
    sync = _sync([first, url], broadcaster)
    with pytest.raises(GenerationServerError, match="phase update_weights, failed on"):
        sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")
    assert first_record.updating and not record.updating
    record.fail = ""
    sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/2")
    assert not first_record.updating and not record.updating
    for _, server in servers:
        assert server.calls[-2:] == [
            ("/finish_weight_update", {"weight_version": "run/2"}),
            ("/collective_rpc", {"method": "lppo_set_version", "args": ["run/2"], "timeout": 5.0}),
        ]


class Rendezvous(Recorded):
    """Rank 0's end waiting for the workers in its rendezvous store as :class:`VLLMBroadcaster` does
    (every rank connected, within the timeout); NCCL's part, which needs GPUs, recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.store: TCPStore | None = None

    def open(self, listener: socket.socket, world: int, timeout: float, failed=lambda: None) -> None:
        super().open(listener, world, timeout)
        self.store = serve_rendezvous(listener, world, timeout, failed)
        self.store.set("broadcast_from/0/0", "id")  # NCCL's id, as vLLM's rank 0 hands it out

    def close(self) -> None:
        super().close()
        self.store = None


@pytest.mark.parametrize("failure", ["an error answered", "its process gone"])
def test_a_server_that_fails_its_init_at_once_is_said_at_once_not_after_the_timeout(servers, failure):
    """One server fails its /init_weight_transfer_engine at once (HTTP 500, or nothing listens at its
    URL any more) while the other's worker waits in rank 0's store. Before, rank 0 waited for every
    rank in its store for the whole generation.server_timeout (600 s here) and only then said the
    server's error. Now the error is the server's own line as soon as it answered; the store is let
    go, so the other worker's wait ends too. The sync runs on a thread joined for at most 30 s: its
    error (kind and words) is the proof that it did not wait out the 600 s."""
    (joined, joined_record), (url, record) = servers
    joined_record.joins_as_worker = True
    if failure == "an error answered":
        record.fail = "/init_weight_transfer_engine"
    else:
        with socket.socket() as closed:  # a port nothing listens on: the server's process died
            closed.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    broadcaster = Rendezvous()
    sync = _sync([joined, url], broadcaster, timeout=600.0)
    raised: list[BaseException] = []

    def load() -> None:
        try:
            sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")
        except BaseException as err:  # noqa: BLE001  (looked at below)
            raised.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the sync waited for the server's answer past 30 s"
    (error,) = raised
    assert isinstance(error, GenerationServerError) and "\n" not in str(error)
    phase = "phase init_weight_transfer_engine"
    prefix = f"weight sync (generation.sync_transport: nccl), {phase}, failed on {url}: "
    assert str(error).startswith(prefix)
    if failure == "an error answered":
        assert str(error) == prefix + "HTTP 500: CUDA error: an illegal memory access"
    for _ in range(100):  # the other worker's wait ends with the store (at most 10 s)
        if joined_record.worker_ended:
            break
        time.sleep(0.1)
    assert joined_record.worker_ended and joined_record.worker_ended != ["got the id"]
    sync.close()


def test_rank_zero_opens_its_end_once_every_servers_workers_joined_its_store(servers):
    """The wait for the workers, on its thread, returns the store once all of them connected
    (1 + 2 workers, counted as vLLM's create counts them): each worker gets NCCL's id from it."""
    for _, record in servers:
        record.joins_as_worker = True
    broadcaster = Rendezvous()
    sync = NcclSync([ServerClient(url, 30) for url, _ in servers], [1, 1], "127.0.0.1", 30, broadcaster)
    sync.load(iter(WEIGHTS), torch.float32, verify=False, version="run/1")
    assert [record.worker_ended for _, record in servers] == [["got the id"], ["got the id"]]
    assert broadcaster.store is not None and len(broadcaster.sent) == 3
    sync.close()


def test_ctrl_c_while_rank_zero_waits_for_the_workers_lets_its_store_go():
    """Ctrl-C (here raised where the servers' answers are looked at) while one of three workers has
    joined: the wait ends with it, the store is let go (the joined worker's wait for NCCL's id ends
    with it) and the thread that served it has ended."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ended: list[str] = []

    def worker() -> None:
        wait = timedelta(seconds=30)
        joined = TCPStore("127.0.0.1", port, 4, is_master=False, timeout=wait, use_libuv=False)
        with contextlib.suppress(Exception):
            joined.get("broadcast_from/0/0")
        ended.append("ended")

    threading.Thread(target=worker, daemon=True).start()
    looked = []

    def failed() -> BaseException | None:
        looked.append(1)
        return KeyboardInterrupt() if len(looked) > 5 else None

    with listener, pytest.raises(KeyboardInterrupt):
        serve_rendezvous(listener, 4, 600, failed)
    for _ in range(100):  # at most 10 s
        if ended:
            break
        time.sleep(0.1)
    assert ended == ["ended"]
    assert not [t for t in threading.enumerate() if t.name == "lppo-nccl-rendezvous"]


class _NoNccl:
    """vLLM's ``PyNcclCommunicator`` where NCCL cannot be used: its constructor fails ("raises"), or
    it comes up unavailable ("unavailable", as vLLM's does without an NCCL library). It keeps the
    rendezvous it was given, as vLLM's does, before it fails."""

    how = "raises"

    def __init__(self, group, device=None) -> None:
        self.group, self.available, self.disabled = group, False, True
        if self.how == "raises":
            raise RuntimeError("NCCL error: unhandled system error")


def _fake_vllm(monkeypatch, how: str) -> None:
    """The three vLLM modules :meth:`VLLMBroadcaster.open` imports (vLLM is not in this environment,
    and its communicator needs CUDA): a communicator that fails (:class:`_NoNccl`), vLLM's
    ``StatelessProcessGroup`` reduced to the store it holds, and its NCCL environment guard."""
    import types

    communicator = type("PyNcclCommunicator", (_NoNccl,), {"how": how})
    modules = {
        "vllm": {},
        "vllm.distributed": {},
        "vllm.distributed.device_communicators": {},
        "vllm.distributed.device_communicators.pynccl": {"PyNcclCommunicator": communicator},
        "vllm.distributed.utils": {"StatelessProcessGroup": types.SimpleNamespace},  # rank, world_size, store
        "vllm.utils": {},
        "vllm.utils.nccl": {"unpinned_nccl_env": contextlib.nullcontext},
    }  # fmt: skip
    for name, attributes in modules.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__name__=name, **attributes))


@pytest.mark.parametrize("how", ["raises", "unavailable"])
def test_a_failure_opening_nccl_after_the_store_is_served_lets_the_store_go(monkeypatch, how):
    """vLLM's communicator fails (or finds no NCCL) once every worker joined rank 0's store, before
    rank 0 hands out NCCL's id: the error's traceback kept the store alive (a notebook keeps the
    error), so a joined worker waited for the id its whole timeout (30 s here; the servers'
    generation.server_timeout). Now the store goes with the failure, the error still held: the
    worker's wait ends at once (at most 10 s asserted)."""
    from lightning_ppo.rollout.engines.server.nccl_sync import VLLMBroadcaster

    _fake_vllm(monkeypatch, how)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ended: list[float] = []

    def worker() -> None:
        wait = timedelta(seconds=30)
        joined = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=wait, use_libuv=False)
        with contextlib.suppress(Exception):
            joined.get("broadcast_from/0/0")  # NCCL's id, never handed out
        ended.append(time.monotonic())

    threading.Thread(target=worker, daemon=True).start()
    with listener, pytest.raises(RuntimeError) as caught:
        VLLMBroadcaster().open(listener, 2, 600, lambda: None)
    failed = time.monotonic()
    for _ in range(100):  # at most 10 s
        if ended:
            break
        time.sleep(0.1)
    assert ended, "the joined worker still waits for NCCL's id while the error is held"
    assert caught.value is not None  # held until here, as a notebook holds it
    assert ended[0] - failed < 10
