"""The ``vllm_server`` engine's parts that need no vLLM: the checksum comparison, the weights file,
the bounded HTTP calls, the settings and ``lightning-ppo serve``'s command line. The engine against
real servers is tests/test_vllm_server.py (``make test-vllm``)."""

from __future__ import annotations

import asyncio
import gc
import http.server
import itertools
import json
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from safetensors.torch import load_file
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.models.loading import load_causal_lm
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.server import VLLMServerEngine
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.key_guard import GuardEveryRoute
from lightning_ppo.rollout.engines.server.weight_sync import (
    checksum,
    combine_workers,
    mismatch,
    sweep_leftovers,
    unchecked,
    write_weights,
)
from lightning_ppo.rollout.sampling import hf_generation_config
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.serve import EXTENSION, GUARD, server_command
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
    # A tensor no parameter can be followed to (quantized, renamed) is never a refusal: said unchecked.
    assert mismatch(sums, _held({"a.weight": new["a.weight"]}), {}) is None
    assert "cannot follow 1 of the 2 written tensors (first 'b.weight')" in unchecked(
        sums, _held({"a.weight": new["a.weight"]}), {}
    )
    assert "cannot follow 2 of the 2" in unchecked(sums, _held({"other.weight": new["a.weight"]}), {})


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
    """The server never answers: the call ends at its own timeout (0.5 s), not the default one (300 s)
    or never; the bound asserted (30 s) is far from both, so a loaded machine cannot flip it."""
    client = ServerClient(f"http://127.0.0.1:{silent_port}", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(GenerationServerError) as caught:
        client.post("/v1/completions", {"prompt": [1]})
    assert time.monotonic() - start < 30
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


class _Quiet(http.server.BaseHTTPRequestHandler):
    """A fake server's handler: :meth:`reply` sends one answer; nothing is logged."""

    def reply(self, body: bytes, status: int = 200, length: int | None = None) -> None:
        """``body`` with ``status``; ``length``: a Content-Length other than the body's (one cut short)."""
        self.send_response(status)
        self.send_header("Content-Length", str(length or len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Refusing(_Quiet):
    """Answers every POST as vLLM answers a failed call."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"error": {"message": "Worker failed with error \'no method lppo_load\'", "code": 500}}'
        self.reply(body, status=500)


def test_an_error_status_carries_the_servers_message():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = ServerClient(f"http://127.0.0.1:{server.server_port}", timeout=5)
        with pytest.raises(
            GenerationServerError,
            match=r"\(/collective_rpc lppo_load\): HTTP 500: Worker failed with error 'no method lppo_load'",
        ):
            client.rpc("lppo_load", "/tmp/x")  # the method named: a version check after a batch, a load...
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


class _Cycle:
    """An object that refers to itself: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


class _DropDuringFit(Callback):
    """Drops the last reference to a cycle made before the fit, as training starts, and notes whether
    a full collection then freed it."""

    def __init__(self, held: list[_Cycle]) -> None:
        self.held = held
        self.freed_during: bool | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        alive = weakref.ref(self.held[0])
        self.held.clear()
        gc.collect()
        self.freed_during = alive() is None


def test_a_server_fit_leaves_its_starting_objects_out_of_the_collector_until_it_ends(tmp_path, tiny_policy):
    """A cycle made before a vllm_server fit and dropped during it is not freed by a full collection
    while the fit runs (the fit's objects of its start are frozen: a batch's full collections skip
    them), and is as the fit ends, a failed one too: nothing stays frozen, and what died meanwhile is
    collected then (not left to a child forked later). Before, it was freed during the fit."""
    held = [_Cycle()]
    alive = weakref.ref(held[0])
    generation = GenerationConfig(
        max_new_tokens=4, engine="vllm_server", server_urls=[f"http://127.0.0.1:{_closed_port()}"]
    )
    module = PPOLightningModule(
        policy=str(tiny_policy),
        reward_fn=lambda p, c, b: [1.0] * len(c),
        ppo=PPOConfig(),
        generation=generation,
    )
    dropping = _DropDuringFit(held)
    with pytest.raises(GenerationServerError):
        quiet_trainer(tmp_path, iterations=1, callbacks=[dropping]).fit(module, prompt_data())
    assert dropping.freed_during is False
    assert gc.get_freeze_count() == 0
    assert alive() is None  # collected as the fit ended


def _module_of_a_down_server(tiny_policy) -> PPOLightningModule:
    """A vllm_server module whose server is down: its fit fails at the first rollout."""
    generation = GenerationConfig(
        max_new_tokens=4, engine="vllm_server", server_urls=[f"http://127.0.0.1:{_closed_port()}"]
    )
    return PPOLightningModule(
        policy=str(tiny_policy),
        reward_fn=lambda p, c, b: [1.0] * len(c),
        ppo=PPOConfig(),
        generation=generation,
    )


class _FailingOnException(Callback):
    """A user's callback whose own on_exception raises: Lightning skips the later callbacks' hooks."""

    def on_exception(self, trainer, pl_module, exception) -> None:
        raise RuntimeError("the user's on_exception failed")


def test_a_fit_whose_freeze_was_left_by_a_skipped_hook_frees_it_for_the_next_fit(tmp_path, tiny_policy):
    """A user's callback (before ours) raises in on_exception, so Lightning never calls ours: the
    fit's freeze is left held. The next fit of the process, which ends as it should, thaws it (the
    fit left behind is known as ended). Before, the freeze stayed for good: the next fit counted
    itself a second holder and left 1 held as it ended."""
    with pytest.raises(RuntimeError, match="the user's on_exception failed"):
        trainer = quiet_trainer(tmp_path, iterations=1, callbacks=[_FailingOnException()])
        trainer.fit(_module_of_a_down_server(tiny_policy), prompt_data())
    with pytest.raises(GenerationServerError):
        quiet_trainer(tmp_path, iterations=1).fit(_module_of_a_down_server(tiny_policy), prompt_data())
    frozen = gc.get_freeze_count()
    gc.unfreeze()  # nothing left frozen for the later tests either way
    assert frozen == 0


class _MeetingDuringFit(Callback):
    """Two fits on two threads meet as training starts; one of them then waits for the other's end
    and notes whether its own objects were still frozen then."""

    def __init__(self, met: threading.Barrier, other_ended: threading.Event | None) -> None:
        self.met, self.other_ended = met, other_ended
        self.frozen_after_other: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.met.wait(timeout=60)
        if self.other_ended is not None:
            self.other_ended.wait(timeout=60)
            self.frozen_after_other = gc.get_freeze_count()


def test_two_server_fits_on_two_threads_hold_the_freeze_until_the_last_ends(tmp_path, tiny_policy):
    """The fit that ends first leaves the other's freeze held (its objects still frozen as it trains
    on); the last one's end thaws them: nothing is frozen after both."""
    met, first_ended = threading.Barrier(2), threading.Event()
    first, last = _MeetingDuringFit(met, None), _MeetingDuringFit(met, first_ended)
    errors: list[BaseException] = []

    # the modules are built here: two threads loading models at once race on transformers' shared
    # registries ("OrderedDict mutated during iteration", seen once in a run of this file)
    modules = {"first": _module_of_a_down_server(tiny_policy), "last": _module_of_a_down_server(tiny_policy)}

    def fit(callback: Callback, root: Path, then: threading.Event | None) -> None:
        try:
            quiet_trainer(root, iterations=1, callbacks=[callback]).fit(modules[root.name], prompt_data())
        except BaseException as err:  # noqa: BLE001 (each fit fails at its first rollout)
            errors.append(err)
        finally:
            if then is not None:
                then.set()

    threads = [
        threading.Thread(target=fit, args=(first, tmp_path / "first", first_ended)),
        threading.Thread(target=fit, args=(last, tmp_path / "last", None)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    assert [type(err) for err in errors] == [GenerationServerError, GenerationServerError]
    assert last.frozen_after_other and last.frozen_after_other > 0
    assert frozen == 0


class _FreezingDuringFit(Callback):
    """A user's own gc.freeze() as training starts (before forking workers, say)."""

    def on_train_start(self, trainer, pl_module) -> None:
        gc.freeze()


def test_a_users_freeze_during_a_server_fit_is_left_as_they_froze_it(tmp_path, tiny_policy):
    """The user froze the process's objects during the fit (theirs covers ours): the fit's end
    leaves them frozen, as the user asked, rather than thaw everything. Before, the fit's end
    thawed the user's freeze with its own (0 left frozen)."""
    try:
        with pytest.raises(GenerationServerError):
            trainer = quiet_trainer(tmp_path, iterations=1, callbacks=[_FreezingDuringFit()])
            trainer.fit(_module_of_a_down_server(tiny_policy), prompt_data())
        frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert frozen > 0


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


SYNCED = "run/1"  # the weights version of _server_engine's last sync


class _Stuck(_Quiet):
    """A server whose workers answer the weights-version call (``version``) and whose completions
    never come until ``release`` is set, at the test's end (a hung engine); records the
    Authorization header of each call. Each ``stuck`` server has a subclass of its own (its own
    version, release and record): a handler left over from another test cannot write to them."""

    version = SYNCED
    authorizations: list[str | None]
    release: threading.Event

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.authorizations.append(self.headers.get("Authorization"))
        if self.path == "/collective_rpc":
            body = json.dumps({"results": [self.version]}).encode()
            self.reply(body)
            return
        self.release.wait(600)  # set as the test ends: only a test that hangs reaches the bound


class _Backlogged(http.server.ThreadingHTTPServer):
    request_queue_size = 512  # every request of a batch connects at once
    daemon_threads = True


@dataclass
class StuckServer:
    url: str
    handler: type[_Stuck]  # its version, release and record


@pytest.fixture
def stuck() -> Iterator[StuckServer]:
    handler = type("Stuck", (_Stuck,), {"authorizations": [], "release": threading.Event()})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield StuckServer(f"http://127.0.0.1:{server.server_port}", handler)
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def _server_engine(tiny_policy: Path, url: str, timeout: float) -> VLLMServerEngine:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
    config = GenerationConfig(
        max_new_tokens=4, stop_token="=", engine="vllm_server", server_urls=[url], server_timeout=timeout
    )
    hf = hf_generation_config(config, tokenizer.convert_tokens_to_ids("="), tokenizer.pad_token_id)
    engine = VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    engine.served_names, engine.syncs, engine.tag = ["policy"], 1, "run"  # as after the first sync
    return engine


def test_a_hung_server_stops_the_batch_within_one_timeout(stuck, tiny_policy):
    """300 prompts, 8 requests in flight, on a server that never completes: one error after about
    one server_timeout (2 s), not one per wave of requests (38 x 2 s = 76 s); the bound asserted
    (30 s) is far from both, so a loaded machine cannot flip it. No request waits on a thread of
    its own; the engine's loop thread is a daemon, which does not hold the process's exit."""
    engine = _server_engine(tiny_policy, stuck.url, timeout=2.0)
    engine.max_in_flight = 8  # 38 waves: what one timeout per wave would take is far past the bound
    ids = torch.tensor([[i // 100, i // 10 % 10, i % 10] for i in range(300)])  # 300 distinct prompts
    mask = torch.ones(300, 3, dtype=torch.long)
    start = time.monotonic()
    with pytest.raises(GenerationServerError, match=r"\(/v1/completions\): no (completion|answer)"):
        engine.generate(ids, mask)
    assert time.monotonic() - start < 30
    assert not [t for t in threading.enumerate() if t.name.startswith("lightning-ppo-request")]
    loops = [t for t in threading.enumerate() if t.name == "lightning-ppo-http"]
    assert loops and all(t.daemon for t in loops)
    engine.close()


def test_a_server_restarted_since_the_last_sync_stops_the_run_before_sampling(stuck, tiny_policy):
    stuck.handler.version = ""  # a restarted server holds its startup checkpoint
    engine = _server_engine(tiny_policy, stuck.url, timeout=5)
    with pytest.raises(GenerationServerError, match=r"holds weights version none .* last sync \(run/1\)"):
        engine.generate(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))


def test_the_api_key_travels_from_the_environment(stuck, monkeypatch):
    client = ServerClient(stuck.url, timeout=5)
    client.rpc("lppo_version")
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    client.rpc("lppo_version")
    assert stuck.handler.authorizations == [None, "Bearer s3cret"]


def _asgi(
    guard: GuardEveryRoute, path: str, key: str | None = None, method: str = "POST", headers: tuple = ()
) -> int:
    """The status the guarded app answers for a request to ``path``."""
    sent: list[dict] = []
    headers = [*headers, *([(b"authorization", f"Bearer {key}".encode())] if key else [])]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, None, send))
    return sent[0]["status"]


def test_the_api_key_guards_dev_modes_routes_too(monkeypatch):
    """vLLM's own key check guards /v1 only; ours every route but the health checks."""

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    assert _asgi(GuardEveryRoute(app), "/collective_rpc") == 200  # no key set: nothing to check
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    guard = GuardEveryRoute(app)
    for route in ("/collective_rpc", "/reset_prefix_cache", "/pause", "/v1/completions"):
        assert _asgi(guard, route) == 401
        assert _asgi(guard, route, "wrong") == 401
        assert _asgi(guard, route, "s3cret") == 200
    assert _asgi(guard, "/health") == 200


def test_serve_opens_no_other_address_without_a_key(tmp_path):
    """Every server gets the key guard and a key (tests/test_server_keys.py); never on its command line."""
    assert f"--middleware {GUARD}" in " ".join(server_command(str(tmp_path), "127.0.0.1", 1, "auto", []))
    with pytest.raises(UsageError, match="VLLM_API_KEY, not --api-key"):
        server_command(str(tmp_path), "127.0.0.1", 1, "auto", ["--api-key", "s3cret"])


def test_a_server_error_names_its_url_and_route_once(tiny_policy):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        engine = _server_engine(tiny_policy, url, timeout=5)
        with pytest.raises(GenerationServerError) as caught:
            engine._check_server(engine.servers[0], None)
    finally:
        server.shutdown()
        server.server_close()
    assert str(caught.value).count(url) == 1 and "lightning-ppo serve" in str(caught.value)


def test_the_weights_file_is_readable_by_others_and_a_killed_runs_files_are_swept(tmp_path, monkeypatch):
    """0644 under umask 022 (safetensors writes 0600: a server running as another user could not
    read it); a dead process's files (a run killed between write and unlink) are swept, a live one's
    kept; a write that fails leaves no partial file."""
    from lightning_ppo.rollout.engines.server import weight_sync as server_sync
    from lightning_ppo.runs.file_modes import open_mode

    folder = tmp_path / "sync"
    written = write_weights(iter([("a", torch.randn(2))]), folder, torch.float32)
    assert written.path.stat().st_mode & 0o777 == open_mode(folder)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    here = socket.gethostname()
    owner = server_sync._owner(int(dead.stdout))  # this boot, this PID namespace, the dead process
    leftovers = [
        folder / f"lightning-ppo-weights-{here}-{owner}-abc.safetensors",
        folder / f".lightning-ppo-weights-{here}-{owner}-def.partial",
    ]
    elsewhere = folder / f"lightning-ppo-weights-another-node-{owner}-abc.safetensors"
    for path in [*leftovers, elsewhere]:
        path.write_bytes(b"x")
    assert sorted(sweep_leftovers(folder)) == sorted(leftovers)
    # this live process's own, and another machine's (a shared folder: its process ids are not ours)
    assert sorted(p.name for p in folder.iterdir()) == sorted([written.path.name, elsewhere.name])
    elsewhere.unlink()

    def fails(tensors, path):
        Path(path).write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(server_sync, "save_file", fails)
    with pytest.raises(OSError, match="No space"):
        write_weights(iter([("a", torch.randn(2))]), folder, torch.float32)
    assert [p.name for p in folder.iterdir()] == [written.path.name]


def test_a_live_runs_file_from_another_pid_namespace_is_never_swept(tmp_path, monkeypatch):
    """Containers that share a hostname, a user and the sync folder each number their processes
    from 1: a live run's file, named with a process id this namespace does not run, was swept as a
    killed run's (its servers' next load failed on a missing file). The writer's namespace is
    simulated here (another inode, and a process id not running in this one); a file of this
    namespace written by that same dead process id is still swept."""
    from lightning_ppo.rollout.engines.server import weight_sync as server_sync

    folder = tmp_path / "sync"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    boot, namespace, _ = server_sync._owner(0).split(".")
    with monkeypatch.context() as other_container:
        other_container.setattr(server_sync.os, "getpid", lambda: int(dead.stdout))
        other_container.setattr(server_sync, "_owner", lambda pid: f"{boot}.1234567.{pid}")
        live = write_weights(iter([("a", torch.randn(2))]), folder, torch.float32)
    killed = folder / live.path.name.replace(".1234567.", f".{namespace}.")
    killed.write_bytes(b"x")
    assert sweep_leftovers(folder) == [killed]
    assert [p.name for p in folder.iterdir()] == [live.path.name]


def test_weights_sent_in_memory_arrive_whole_in_buckets_on_every_receiver():
    """The weights group (trainer rank 0 and two receivers, here threads): every tensor arrives
    equal, in the sender's order, split over several buckets; a receiver that never joins makes
    the sender's join fail within the group's timeout instead of waiting."""
    from lightning_ppo.rollout.engines.server.local_server import free_port
    from lightning_ppo.rollout.engines.server.weight_group import open_group, receive, send

    torch.manual_seed(0)
    weights = [(f"layer.{i}.weight", torch.randn(64, 16 + i)) for i in range(12)]
    port, got = free_port(), {1: [], 2: []}

    def receiver(rank: int) -> None:
        group = open_group("127.0.0.1", port, rank, 3, 30, "127.0.0.1")
        got[rank] = [(name, tensor.clone()) for name, tensor in receive(group)]

    threads = [threading.Thread(target=receiver, args=(rank,), daemon=True) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    send(open_group("127.0.0.1", port, 0, 3, 30, "127.0.0.1"), iter(weights), bucket_bytes=20_000)
    for thread in threads:
        thread.join(30)
    for rank in (1, 2):
        assert [name for name, _ in got[rank]] == [name for name, _ in weights]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got[rank], weights, strict=True))
    assert not any(thread.is_alive() for thread in threads)
    # Nobody joins: the group's own timeout (2 s) ends the wait, not torch's default (30 min); the
    # bound asserted (60 s) is far from both, so a loaded machine cannot flip it.
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (torch's store raises its own timeout types)
        open_group("127.0.0.1", free_port(), 0, 2, 2, "127.0.0.1")
    assert time.monotonic() - start < 60


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="reads Linux's socket tables")
def test_the_weights_store_listens_on_the_sync_address_alone():
    """Rank 0's store for the weights group listens on the address it is given (here loopback), not
    on every interface of the machine, which is what torch's TCPStore does given only a port."""
    from lightning_ppo.rollout.engines.server.weight_group import listening_socket, open_group, receive, send

    listener = listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    got = []
    joiner = threading.Thread(
        target=lambda: got.extend(receive(open_group("127.0.0.1", port, 1, 2, 30, "127.0.0.1"))), daemon=True
    )
    joiner.start()
    group = open_group("127.0.0.1", port, 0, 2, 30, "127.0.0.1", listener=listener)
    assert listener.fileno() == -1  # closed here; the store serves on its own descriptor
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and nothing else
    send(group, iter([("w", torch.ones(3))]))
    joiner.join(30)
    assert [(name, tensor.tolist()) for name, tensor in got] == [("w", [1.0, 1.0, 1.0])]


def test_a_groups_copies_go_as_one_request_seeded_as_the_colocated_engine_seeds_its_rows():
    """Consecutive copies of one prompt (``num_generations``) are one request of ``n`` samples, which
    vLLM seeds seed + i; the colocated engine gives its rows the same seeds. Without copies, one
    draw per row, as before."""
    from lightning_ppo.rollout.engines.completions import group_seeds, prompt_groups, row_seeds

    rows = [[1, 2], [1, 2], [1, 2], [3], [1, 2]]
    assert prompt_groups(rows) == [(0, 3), (3, 1), (4, 1)]
    torch.manual_seed(5)
    drawn = group_seeds(prompt_groups(rows))
    torch.manual_seed(5)
    assert row_seeds(rows) == [drawn[0], drawn[0] + 1, drawn[0] + 2, drawn[1], drawn[2]]
    torch.manual_seed(5)
    before = torch.randint(0, 2**31 - 1, (3,)).tolist()
    torch.manual_seed(5)
    assert row_seeds([[1], [2], [1]]) == before


def test_any_failure_of_rank_zeros_sync_is_one_line_for_every_rank(tmp_path, tiny_policy):
    """A weights file that cannot be written (``sync_dir`` is a file): not an OSError escaping rank 0
    before the verdict is broadcast (the other ranks would wait for it), but the one-line error
    every rank raises."""
    (tmp_path / "not-a-folder").write_text("")
    engine = _server_engine(tiny_policy, "http://127.0.0.1:9", timeout=5)
    engine.config = GenerationConfig(
        engine="vllm_server",
        server_urls=["http://127.0.0.1:9"],
        sync_transport="file",
        sync_dir=str(tmp_path / "not-a-folder" / "sync"),
    )
    engine.sync_dir = Path(engine.config.sync_dir)
    engine.described = [{"dtype": "float32", "packed_modules": {}, "workers": 1}]
    verdicts = []
    engine.from_rank_zero = lambda error: verdicts.append(error) or error
    with pytest.raises(
        GenerationServerError, match="weight sync failed: (FileExistsError|NotADirectoryError)"
    ):
        engine.sync_weights(load_causal_lm(str(tiny_policy)))
    assert len(verdicts) == 1 and verdicts[0][0].startswith("weight sync failed")  # (error, run tag)


class _OneAtATime(_Quiet):
    """A busy server: completes one request every ``GAP`` seconds, in turn (vLLM answers a
    non-streamed request only when it is done, so a queued one's socket is silent until then)."""

    GAP = 0.15
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/collective_rpc":
            answer = {"results": [SYNCED]}
        else:
            with _OneAtATime.lock:  # the sleep paces the answers: it waits for no other thread
                time.sleep(self.GAP)
            choice = {"index": 0, "token_ids": [3, 4], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
            answer = {"choices": [{**choice, "index": i} for i in range(request["n"])]}
        body = json.dumps(answer).encode()
        self.reply(body)


def test_a_busy_server_that_keeps_answering_is_not_a_hung_one(tiny_policy):
    """30 requests answered one every 0.15 s with server_timeout 3 s: the last waits at least 4.5 s
    (the sleeps' sum: a loaded machine only lengthens it), longer than the timeout, but the batch is
    making progress, so it completes (a socket limit of one timeout per request failed it). Only an
    answer 20 times later than paced, a stall of seconds, would stop it."""
    server = _Backlogged(("127.0.0.1", 0), _OneAtATime)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = _server_engine(tiny_policy, f"http://127.0.0.1:{server.server_port}", timeout=3.0)
        ids = torch.tensor([[i // 10, i % 10, 2] for i in range(30)])  # 30 distinct prompts
        rollout = engine.generate(ids, torch.ones_like(ids))
    finally:
        server.shutdown()
        server.server_close()
    assert rollout.response_ids.shape == (30, 2)
    assert torch.allclose(rollout.engine_logprobs[0], torch.tensor([-0.5, -0.25]))


def test_the_api_key_is_read_without_its_line_end_and_never_echoed(monkeypatch):
    from lightning_ppo.rollout.engines.server.client import auth_headers

    monkeypatch.setenv("VLLM_API_KEY", "s3cret\r\n")  # a secret made from a file
    assert auth_headers() == {"Authorization": "Bearer s3cret"}
    monkeypatch.setenv("VLLM_API_KEY", "s3c ret")
    with pytest.raises(UsageError) as caught:
        auth_headers()
    assert "s3c" not in str(caught.value)


def test_serve_refuses_an_address_after_the_double_dash(tmp_path):
    """``-- --host 0.0.0.0`` would win over the checked ``--host`` (vLLM keeps the last one)."""
    for extra in (["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--port", "1"], ["--uds", "/tmp/s"]):
        with pytest.raises(UsageError, match="before `--`"):
            server_command(str(tmp_path), "127.0.0.1", 1, "auto", extra)


def test_only_a_cors_preflight_passes_the_guard_without_the_key(monkeypatch):
    """A plain OPTIONS reached /metrics (Prometheus' app ignores the method)."""

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    guard = GuardEveryRoute(app)
    preflight = ((b"origin", b"http://x"), (b"access-control-request-method", b"GET"))
    assert _asgi(guard, "/metrics/", method="OPTIONS") == 401
    assert _asgi(guard, "/metrics/", method="OPTIONS", headers=preflight) == 200


QWEN_VOCAB = 151_936  # Qwen2.5's: the size the suppressed-token encoding was measured at


def _suppressing_engine(tiny_policy: Path, url: str, suppressed: list[int], vocab: int) -> VLLMServerEngine:
    engine = _server_engine(tiny_policy, url, timeout=5)
    engine.vocab_size = vocab
    engine.hf_generation.suppress_tokens = suppressed
    return engine


def test_a_request_is_sent_as_the_bytes_of_its_definition_whatever_its_settings(tiny_policy):
    """_encoded (a batch's shared fields encoded once) sends the very bytes json.dumps makes of
    _request, for every request of a batch alike: per-prompt n, seeds up to 2**63 - 1, two served
    names, exact or not, suppressed tokens as a bias, as the allowed ids or none, greedy or
    sampled, the cache filled by one setting and asked for another. Before, the bytes differed
    (the fields in another order and spacing), only their parsed JSON was checked."""
    for suppressed in ([], [7, 151_000], list(range(100, QWEN_VOCAB))):
        engine = _suppressing_engine(tiny_policy, "http://127.0.0.1:9", suppressed, QWEN_VOCAB)
        for sampled in (True, False):
            engine.hf_generation.do_sample = sampled
            engine.shared_json.clear()  # a new batch: its settings encoded again
            for model, prompt, seed, n, exact in itertools.product(
                ("policy", "other"), ([1, 2, 3], [5]), (0, 2**63 - 1), (1, 4), (False, True)
            ):
                sent = engine._encoded(model, prompt, seed, n, exact)
                assert sent == json.dumps(engine._request(model, prompt, seed, n, exact)).encode()


def test_a_few_suppressed_tokens_go_as_a_bias_and_most_of_the_vocabulary_as_the_allowed_ids(tiny_policy):
    """151,936 tokens, 2 suppressed: a request of a few hundred bytes with logit_bias -100 on the two
    (the allowed list was about 1 MB of JSON in every request); a pattern that suppresses most of
    the vocabulary goes as the allowed ids, the smaller then; an exact request always does."""
    few = _suppressing_engine(tiny_policy, "http://127.0.0.1:9", [7, 151_000], QWEN_VOCAB)
    request = few._request("policy", [1, 2, 3], seed=5, n=4)
    assert len(json.dumps(request).encode()) < 2_000
    assert json.loads(few._encoded("policy", [1, 2, 3], 5, 4, exact=False)) == request  # as sent
    exact_sent = few._encoded("policy", [1], 6, 1, exact=True)
    assert json.loads(exact_sent) == few._request("policy", [1], 6, 1, exact=True)
    assert request["logit_bias"] == {"7": -100, "151000": -100} and "allowed_token_ids" not in request
    exact = few._request("policy", [1, 2, 3], seed=5, n=1, exact=True)
    assert "logit_bias" not in exact and len(exact["allowed_token_ids"]) == QWEN_VOCAB - 2
    assert 7 not in exact["allowed_token_ids"] and 151_000 not in exact["allowed_token_ids"]
    most = _suppressing_engine(tiny_policy, "http://127.0.0.1:9", list(range(100, QWEN_VOCAB)), QWEN_VOCAB)
    request = most._request("policy", [1, 2, 3], seed=5)
    assert request["allowed_token_ids"] == list(range(100)) and "logit_bias" not in request
    none = _suppressing_engine(tiny_policy, "http://127.0.0.1:9", [], QWEN_VOCAB)._request("policy", [1], 5)
    assert "logit_bias" not in none and "allowed_token_ids" not in none


class _Biased(_Quiet):
    """A server whose bias is not enough: under ``logit_bias`` sample 1 of a request holds the
    suppressed id 7 (a model that puts its logit 100 above the rest); under ``allowed_token_ids``
    every sample holds 4 there instead (7 where ``ignores_allowed``). Records every completion
    request."""

    requests: list[dict] = []
    ignores_allowed = False

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/collective_rpc":
            answer = {"results": [_Stuck.version]}
        else:
            _Biased.requests.append(request)
            exact = "allowed_token_ids" in request
            held = 7 if not exact or _Biased.ignores_allowed else 4

            def choice(i: int) -> dict:
                tokens = [3, held] if i == 1 or exact else [3, 5]
                return {"index": i, "token_ids": tokens, "logprobs": {"token_logprobs": [-0.5, -0.5 - exact]}}

            answer = {"choices": [choice(i) for i in range(request["n"])][::-1]}  # in any order
        body = json.dumps(answer).encode()
        self.reply(body)


@pytest.fixture
def biased() -> Iterator[str]:
    server = _Backlogged(("127.0.0.1", 0), _Biased)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Biased.requests.clear()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        _Biased.ignores_allowed = False
        server.shutdown()
        server.server_close()


def test_a_sample_holding_a_suppressed_token_is_requested_again_exactly(biased, tiny_policy):
    """A group of 3 copies sent with logit_bias comes back with a suppressed id in sample 1: that
    sample alone is requested again under allowed_token_ids, with the seed vLLM gave it in the
    group (seed + 1), once; the rollout holds the exact answer, its tokens and log-probs."""
    engine = _suppressing_engine(
        tiny_policy, biased, [7], len(AutoTokenizer.from_pretrained(str(tiny_policy)))
    )
    ids = torch.tensor([[1, 2, 3]] * 3)
    torch.manual_seed(0)
    rollout = engine.generate(ids, torch.ones_like(ids))
    first, again = _Biased.requests
    assert "logit_bias" in first and first["n"] == 3 and "allowed_token_ids" not in first
    assert "logit_bias" not in again and 7 not in again["allowed_token_ids"]
    assert (again["n"], again["seed"], again["prompt"]) == (1, first["seed"] + 1, first["prompt"])
    assert engine.exact_requests == 1 and engine.requests_sent == [2]
    assert rollout.response_ids.tolist() == [[3, 5], [3, 4], [3, 5]]
    assert rollout.engine_logprobs.tolist() == [[-0.5, -0.5], [-0.5, -1.5], [-0.5, -0.5]]


def test_a_server_that_ignores_the_allowed_ids_stops_the_batch_in_one_line(biased, tiny_policy):
    _Biased.ignores_allowed = True
    engine = _suppressing_engine(
        tiny_policy, biased, [7], len(AutoTokenizer.from_pretrained(str(tiny_policy)))
    )
    ids = torch.tensor([[1, 2, 3]] * 2)
    with pytest.raises(GenerationServerError) as caught:
        engine.generate(ids, torch.ones_like(ids))
    assert str(caught.value) == (
        f"generation server {biased} (/v1/completions): sampled the suppressed token id 7 under "
        "allowed_token_ids: it ignores them"
    )
    assert len(_Biased.requests) == 2  # once, not again and again


class _KeepAlive(_Quiet):
    """A server that keeps connections open between answers (HTTP/1.1) and answers every completion
    at once; records the client's threads (those not the fake server's own) at each request."""

    protocol_version = "HTTP/1.1"
    requests = 0
    client_threads: set[tuple[int | None, str]] = set()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        _KeepAlive.requests += 1
        _KeepAlive.client_threads |= {
            (t.ident, t.name) for t in threading.enumerate() if not t.name.startswith("fake-server")
        }
        choice = {"token_ids": [3, 4], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
        body = json.dumps({"choices": [{**choice, "index": i} for i in range(request["n"])]}).encode()
        self.reply(body)


class _Counting(_Backlogged):
    """Counts the TCP connections it accepts; its threads are named, to tell them from the client's."""

    connections = 0

    def process_request(self, request, client_address) -> None:
        type(self).connections += 1
        serve = partial(self.process_request_thread, request, client_address)
        threading.Thread(target=serve, name="fake-server", daemon=True).start()


@pytest.fixture
def counting() -> Iterator[type[_Counting]]:
    server = type("Counting", (_Counting,), {"connections": 0})(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=server.serve_forever, name="fake-server-main", daemon=True).start()
    _KeepAlive.requests, _KeepAlive.client_threads = 0, set()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_batch_of_300_requests_runs_on_one_loop_over_pooled_connections(counting, tiny_policy):
    """300 requests, 32 in flight: the client runs no thread per request (its threads during the
    batch are the ones before it and the engine's loop), and its connections are reused (at most 32
    opened, one per request before). The module's callbacks close them as a fit ends (the loop's
    thread ends), and the next batch (a second fit) opens them again."""
    url = f"http://127.0.0.1:{counting.server_address[1]}"
    engine = _server_engine(tiny_policy, url, timeout=30)
    engine.max_in_flight = 32
    engine.syncs = 0  # this fake server keeps no weights version
    ids = torch.tensor([[i // 100, i // 10 % 10, i % 10] for i in range(300)])  # 300 distinct prompts
    before = {(t.ident, t.name) for t in threading.enumerate() if not t.name.startswith("fake-server")}
    rollout = engine.generate(ids, torch.ones_like(ids))
    assert rollout.response_ids.shape == (300, 2) and _KeepAlive.requests == 300
    new = _KeepAlive.client_threads - before
    assert [name for _, name in new] == ["lightning-ppo-http"]
    assert counting.connections <= 32
    (loop,) = [t for t in threading.enumerate() if (t.ident, t.name) in new]
    assert loop.daemon
    module = PPOLightningModule(
        policy=str(tiny_policy),
        reward_fn=lambda p, c, b: [1.0] * len(c),
        generation=GenerationConfig(engine="vllm_server", server_urls=[url]),
    )
    module._engine = engine
    for callback in module.configure_callbacks():  # as a fit ends
        callback.teardown(None, module, "fit")
    assert not loop.is_alive()  # the loop's thread ends with the connections
    assert engine.generate(ids[:40], torch.ones_like(ids[:40])).response_ids.shape == (40, 2)
    assert _KeepAlive.requests == 340 and counting.connections <= 64
    for callback in module.configure_callbacks():  # as a fit that raised ends
        callback.on_exception(None, module, RuntimeError())
    assert engine._connections is None


def test_a_forked_child_makes_connections_of_its_own(counting, tiny_policy, monkeypatch):
    """A loop's thread does not survive a fork: in a child (another process id) the parent's
    connections are not used, nor touched when the child closes them."""
    from lightning_ppo.rollout.engines.server import connections as server_connections

    engine = _server_engine(tiny_policy, f"http://127.0.0.1:{counting.server_address[1]}", timeout=30)
    parents = engine._connected()
    assert parents.serves(engine.max_in_flight)
    monkeypatch.setattr(server_connections.os, "getpid", lambda: parents.pid + 1)  # as the child sees it
    assert not parents.serves(engine.max_in_flight)
    parents.close()
    monkeypatch.undo()
    assert parents.thread.is_alive()  # the parent's loop, left alone
    server_connections._shut(parents.loop, parents.thread, parents.sessions, parents.pid)
    assert not parents.thread.is_alive()


class _Holding(_Quiet):
    """Completions that never come, each held until its client closes the connection (the fake
    server records it) or the test ends; ``failing`` prompts are answered HTTP 500 once
    ``held_first`` requests are held (so the failure ends a batch with those out, whichever thread
    runs first)."""

    held: list[int]
    closed: list[int]
    failing: list[list[int]]
    held_first = 0
    release: threading.Event
    holding: threading.Condition

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if request.get("prompt") in self.failing:
            with self.holding:  # a guard: the others are sent at once, held within milliseconds
                self.holding.wait_for(lambda: len(self.held) >= self.held_first, timeout=60)
            body = b'{"error": {"message": "no room", "code": 500}}'
            self.reply(body, status=500)
            return
        with self.holding:
            self.held.append(1)
            self.holding.notify_all()
        deadline = time.monotonic() + 120  # bounded: the test ends long before, or fails
        while not self.release.is_set() and time.monotonic() < deadline:
            if select.select([self.connection], [], [], 0.1)[0]:
                if not self.connection.recv(1, socket.MSG_PEEK):  # the client closed it
                    self.closed.append(1)
                    return


class _Joined(_Backlogged):
    """Its request threads are joined by ``server_close``: once it returns, each request the server
    read has ended, and nothing more is counted."""

    daemon_threads = False


@pytest.mark.parametrize("ending", ["stalled", "failed"])
def test_a_batch_that_ends_early_leaves_no_request_running(ending, tiny_policy):
    """A batch stopped by a stall (no answer within server_timeout) or by one request's HTTP 500
    while the other 7 in flight are held: every request it left is cancelled, its connection closed
    (the server sees each one close), not left to wait on its socket for minutes. The server is
    closed before counting, which waits for each request it read to see its close (or fail at its
    120 s bound): no count is read while a request is still on its way."""
    handler = type(
        "Holding",
        (_Holding,),
        {
            "held": [],
            "closed": [],
            "failing": [],
            "release": threading.Event(),
            "holding": threading.Condition(),
        },
    )
    server = _Joined(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = _server_engine(tiny_policy, f"http://127.0.0.1:{server.server_port}", timeout=1.0)
        engine.max_in_flight, engine.syncs = 8, 0
        ids = torch.tensor([[i // 10, i % 10, 5] for i in range(40)])  # 40 distinct prompts
        if ending == "failed":
            engine.config.server_timeout = 600.0  # only the failure can end the batch early
            handler.failing, handler.held_first = [ids[7].tolist()], 7  # among the first 8 in flight
        with pytest.raises(GenerationServerError, match="no completion of 8|HTTP 500: no room"):
            engine.generate(ids, torch.ones_like(ids))
        server.shutdown()
        server.server_close()  # joins every request's thread: each ends as it sees its close
        assert len(handler.held) >= (7 if ending == "failed" else 1)
        assert len(handler.closed) == len(handler.held)
        engine.close()
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


class _Faulty(_Quiet):
    """Answers every call with its ``fault``."""

    fault = "status"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body, status, length = {
            "status": (b'{"error": {"message": "Worker failed", "code": 500}}', 500, None),
            "unauthorized": (b'{"error": "Unauthorized"}', 401, None),
            "not json": (b"<html>proxy error</html>", 200, None),
            "cut short": (b'{"choices": [', 200, 100),  # promises 100 bytes, sends 13
        }[self.fault]
        self.reply(body, status=status, length=length)


@pytest.mark.parametrize("fault", ["status", "unauthorized", "not json", "cut short", "down", "hung"])
def test_a_batch_says_what_went_wrong_as_a_single_call_does(fault, silent_port):
    """Each failure worded as ServerClient words it (one line naming the URL and route once); an
    answer cut short differs only in the HTTP library's own words for it."""
    from lightning_ppo.rollout.engines.server.connections import Connections

    server = None
    if fault == "down":
        url = f"http://127.0.0.1:{_closed_port()}"
    elif fault == "hung":
        url = f"http://127.0.0.1:{silent_port}"
    else:
        server = _Backlogged(("127.0.0.1", 0), type("Faulty", (_Faulty,), {"fault": fault}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}"
    connections = Connections([ServerClient(url, 0.5)], 4)
    try:
        with pytest.raises(GenerationServerError) as alone:
            ServerClient(url, 0.5).post("/v1/completions", {"prompt": [1]})
        call = partial(connections.sessions[0].post, "/v1/completions", {"prompt": [1]}, 0.5)
        with pytest.raises(GenerationServerError) as batched:
            connections.send([call], 30)
    finally:
        connections.close()
        if server is not None:
            server.shutdown()
            server.server_close()
    expected = str(alone.value)
    if fault == "cut short":
        expected = expected[: expected.index("(", expected.index("broke off")) + 1]
    assert str(batched.value).startswith(expected) and str(batched.value).count(url) == 1, (
        str(batched.value),
        str(alone.value),
    )


class _Dropping(_KeepAlive):
    """Closes a connection without an answer: at the second request on it (``every`` False: a
    kept-alive connection whose timer fired as the request went out), or at once (``every``)."""

    every = False
    seen = 0
    connections = 0

    def setup(self) -> None:  # one handler per connection
        super().setup()
        type(self).connections += 1
        self.here = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        type(self).seen += 1
        self.here += 1
        if self.here == 1 and not self.every:
            return super().do_POST()
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.close_connection = True  # no answer: the connection closes


@pytest.mark.parametrize("every", [False, True])
def test_a_request_on_a_kept_alive_connection_the_server_closed_is_sent_again(every, tiny_policy):
    """One request at a time, each connection closed at its second request: the request goes
    again on a new connection, and the batch completes (3 requests: 5 sent on 3 connections). A
    new connection closed without an answer is one error at once, saying the server broke off."""
    handler = type("Dropping", (_Dropping,), {"every": every, "seen": 0, "connections": 0})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = _server_engine(tiny_policy, f"http://127.0.0.1:{server.server_port}", timeout=30)
        engine.max_in_flight, engine.syncs = 1, 0
        ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
        if every:
            with pytest.raises(GenerationServerError, match=r"\(/v1/completions\): broke off its answer"):
                engine.generate(ids, torch.ones_like(ids))
        else:
            assert engine.generate(ids, torch.ones_like(ids)).response_ids.tolist() == [[3, 4]] * 3
        engine.close()
    finally:
        server.shutdown()
        server.server_close()
    assert (handler.seen, handler.connections) == ((1, 1) if every else (5, 3))


class _Restarting(_Quiet):
    """A server that restarts as the second completion arrives: it drops that request unanswered
    (as a dying server drops what is on its connections) and comes back holding its startup
    checkpoint (weights version "", whose samples are [5, 6] where the synced weights' are [3, 4]).
    Keeps connections open between answers, so the dropped request went out on a kept-alive one
    and the client sends it again, to the restarted server."""

    protocol_version = "HTTP/1.1"
    version = SYNCED
    completions = 0
    by_startup = 0  # completions answered with the startup checkpoint

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/collective_rpc":
            self.reply(json.dumps({"results": [self.version]}).encode())
            return
        type(self).completions += 1
        if self.completions == 2:
            type(self).version = ""
            self.close_connection = True
            return
        tokens = [3, 4] if self.version == SYNCED else [5, 6]
        type(self).by_startup += self.version != SYNCED
        choice = {"token_ids": tokens, "logprobs": {"token_logprobs": [-0.5, -0.5]}}
        self.reply(json.dumps({"choices": [{**choice, "index": i} for i in range(request["n"])]}).encode())


def test_a_server_restarted_while_its_batch_is_out_stops_the_run_after_the_batch(tiny_policy, monkeypatch):
    """Three requests one at a time: the first answered by the synced weights, the second dropped by
    the server's restart and sent again on a new connection (4 sent for 3), answered with the
    startup checkpoint, as is the third. The batch is refused in one line naming the server, not
    returned as the synced version's: the next sync would load the restarted server again, and no
    later check would see that one rollout was sampled by two versions."""
    from lightning_ppo.rollout.engines.server import session as server_session

    # The first connection must still be pooled at the second request (a loaded machine may be
    # slower than the 2 s the client keeps an idle one): the resend is what this test is about.
    monkeypatch.setattr(server_session, "KEEP_ALIVE_S", 600.0)
    handler = type("Restarting", (_Restarting,), {"version": SYNCED, "completions": 0, "by_startup": 0})
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        engine = _server_engine(tiny_policy, url, timeout=30)
        engine.max_in_flight = 1
        ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
        with pytest.raises(GenerationServerError) as caught:
            engine.generate(ids, torch.ones_like(ids))
        engine.close()
    finally:
        server.shutdown()
        server.server_close()
    assert (handler.completions, handler.by_startup) == (4, 2)
    assert str(caught.value).startswith(
        f"generation server {url} (weights version): holds weights version none (its startup "
        "checkpoint), not this run's last sync (run/1): restarted while this batch was out"
    ), str(caught.value)
