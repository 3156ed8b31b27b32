"""Every ``lightning-ppo serve`` server has an API key: without ``VLLM_API_KEY`` it makes one and
writes it to a file only its user can read, named by the server's address, where the trainer
finds it; only ``--no-api-key`` leaves a server open. The real ``lightning-ppo serve`` command and
the real key guard in the server's process, on 127.0.0.1; vLLM replaced by a small aiohttp server
(tests/fake_vllm_server.py) that the ``python -m vllm.entrypoints.openai.api_server`` serve runs
finds first on its ``PYTHONPATH``. Each server is stopped by its test."""

from __future__ import annotations

import _thread
import asyncio
import http.server
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_ppo.rollout.engines.server import local_server
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.local_server import LocalServer
from lightning_ppo.rollout.engines.server.session import ServerSession
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.server_keys import claim_address, key_file, server_key
from lightning_ppo.serve import server_key as server_key_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own (the key files' home), and no VLLM_API_KEY."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return tmp_path / "cache" / "lightning_ppo" / "server_keys"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., LocalServer]]:
    """Starts ``lightning-ppo serve`` (``serve_args`` its own flags) with vLLM's server replaced."""
    shim = tmp_path / "shim" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    (shim / "api_server.py").write_text("from tests.fake_vllm_server import main\n\nmain()\n")
    (tmp_path / "policy").mkdir()
    started: list[LocalServer] = []

    def start(*serve_args: str) -> LocalServer:
        env = {"PYTHONPATH": f"{tmp_path / 'shim'}:{ROOT}"}
        server = LocalServer(tmp_path / "policy", tmp_path / "serve.log", env=env, serve_args=serve_args)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


def _status(url: str, key: str | None = None) -> int:
    """The status of a key-less (or ``key``) call of the route that loads weights."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url + "/collective_rpc", data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def test_serve_makes_a_key_only_its_user_can_read_and_the_trainer_finds_it(keys, serve):
    """No VLLM_API_KEY on either side: the server refuses a key-less caller (it took any before),
    its key is in a 0600 file in a 0700 folder, named by its address, and the trainer's calls
    carry it without a word from the user."""
    server = serve()
    path = key_file(server.url)
    assert path.parent == keys and path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert _status(server.url) == 401
    assert _status(server.url, path.read_text().strip()) == 200
    assert ServerClient(server.url, 30).rpc("lppo_version") == "none"


def test_a_stale_or_missing_key_file_is_one_line_saying_so(keys, serve):
    """The key file of an earlier server at the same address (another key), or none: each call
    refused in one line that says which key was refused, or where none was found, and what to do."""
    server = serve()
    path = key_file(server.url)
    path.write_text("an-earlier-servers-key\n")
    with pytest.raises(GenerationServerError) as stale:
        ServerClient(server.url, 30).rpc("lppo_version")
    assert f"it refused the key in {path}: a stale key of an earlier server at this address?" in str(
        stale.value
    )
    path.unlink()
    with pytest.raises(GenerationServerError) as missing:
        ServerClient(server.url, 30).rpc("lppo_version")
    assert str(missing.value).endswith(
        f"VLLM_API_KEY is unset and there is no key file {path}, which `lightning-ppo serve` writes for the "
        "URL it prints; set VLLM_API_KEY to the server's key)"
    ), str(missing.value)
    assert "\n" not in str(stale.value) + str(missing.value)


@pytest.mark.long  # starts `lightning-ppo serve` twice, 13-17 s
def test_a_server_is_open_only_when_told(keys, serve, monkeypatch):
    """``--no-api-key``: any caller, and no key file. A key of the user's (VLLM_API_KEY): that key
    on every route, and no key file either."""
    open_server = serve("--no-api-key")
    assert _status(open_server.url) == 200 and not key_file(open_server.url).exists()
    monkeypatch.setenv("VLLM_API_KEY", "the-users-key")
    keyed = serve()
    assert _status(keyed.url) == 401 and _status(keyed.url, "the-users-key") == 200
    assert not key_file(keyed.url).exists()
    assert ServerClient(keyed.url, 30).rpc("lppo_version") == "none"


def test_an_earlier_servers_key_file_is_replaced_or_removed(keys, monkeypatch):
    """A server at an address where an earlier one left its key file: a new key replaces it, and a
    server without one of serve's keys (the user's, or none) removes it: the trainer would send it."""
    earlier = key_file("http://127.0.0.1:8000")
    for keyless, users_key in ((False, None), (True, None), (False, "the-users-key")):
        server_key_for("127.0.0.1", 8000, keyless=False)
        written = earlier.read_text()
        if users_key:
            monkeypatch.setenv("VLLM_API_KEY", users_key)
        env, _ = server_key_for("127.0.0.1", 8000, keyless=keyless)
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        if keyless or users_key:
            assert env == {} and not earlier.exists()
        else:
            assert env["VLLM_API_KEY"] == earlier.read_text().strip() != written.strip()


def test_a_key_file_others_can_read_is_refused(keys):
    keys.mkdir(parents=True)
    path = key_file("http://127.0.0.1:8000")
    path.write_text("k\n")
    path.chmod(0o644)
    with pytest.raises(UsageError, match=f"the server key file {path} is readable by other users"):
        server_key("http://127.0.0.1:8000")
    path.chmod(0o600)
    assert server_key("http://127.0.0.1:8000").value == "k"


@pytest.mark.long  # starts `lightning-ppo serve` twice, 13-17 s
def test_a_second_serve_on_a_busy_port_leaves_the_running_servers_key_alone(keys, serve, tmp_path):
    """``serve`` on the port of a running server: refused in one line before a new key replaced the
    running server's key file (the second server then failed to listen, and the trainer was sent a
    key the running server had never seen)."""
    server = serve()
    path = key_file(server.url)
    key = path.read_text()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'shim'}:{ROOT}"}
    command = [sys.executable, "-m", "lightning_ppo.console", "serve", "--policy", str(tmp_path / "policy")]
    second = subprocess.run(
        [*command, "--port", str(server.port)], env=env, capture_output=True, text=True, timeout=240
    )
    assert second.returncode == 2 and second.stderr.strip() == (
        f"lightning-ppo serve: error: lightning-ppo serve --port {server.port}: 127.0.0.1:{server.port} "
        "is in use (a server already runs there?)"
    ), second.stderr
    assert path.read_text() == key
    assert ServerClient(server.url, 30).rpc("lppo_version") == "none"


@pytest.mark.long  # starts `lightning-ppo serve` twice, 13-17 s
def test_a_server_restarted_at_its_address_is_reached_with_its_new_key(keys, serve, monkeypatch):
    """A server restarted by ``serve`` at the same address while a trainer runs writes a new key:
    the trainer's next call (a stdlib call and a pooled one) carries it, once the old one is refused,
    so the run hears what happened (the version check: restarted), not that a key file is stale.
    Before, the client kept the key it had read first: 401 naming a file that held the right key."""
    first = serve()
    client, pooled = ServerClient(first.url, 30), ServerClient(first.url, 30)
    assert client.rpc("lppo_version") == pooled.rpc("lppo_version") == "none"  # each holds the key now
    old_key = key_file(first.url).read_text()
    first.stop()
    monkeypatch.setattr(local_server, "free_port", lambda: first.port)
    second = serve()
    assert second.url == first.url and key_file(second.url).read_text() != old_key
    assert client.rpc("lppo_version") == "none"
    session = ServerSession(pooled, 1)

    async def call() -> object:
        try:
            return await session.post("/collective_rpc", {"method": "lppo_version", "args": []}, 30)
        finally:
            await session.close()

    assert asyncio.run(call()) == {"results": ["none"]}


@pytest.mark.long  # starts `lightning-ppo serve` twice, 13-17 s
def test_a_second_serve_while_the_first_starts_leaves_its_key_alone(keys, tmp_path):
    """Two ``serve`` at one address, the second while the first's server starts (vLLM binds its
    port only once imported: seconds): the second is refused in one line and the first's key file
    is left alone. Before, both found the port free, the second's key replaced the first's, the
    second's server failed to bind, and the running one refused the trainer's key (5 of 6 pairs
    started at once with the plain fake server)."""
    shim = tmp_path / "slow" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    started = tmp_path / "started"  # the first server's shim says when it runs, then waits to bind
    (shim / "api_server.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "time.sleep(8)  # vLLM's imports, before it binds its port\n"
        "from tests.fake_vllm_server import main\n\nmain()\n"
    )
    (tmp_path / "policy").mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'slow'}:{ROOT}"}
    port = local_server.free_port()
    command = [sys.executable, "-m", "lightning_ppo.console", "serve", "--policy", str(tmp_path / "policy")]
    command += ["--port", str(port)]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # at most 60 s
            if started.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists() and first.poll() is None
        key = key_file(f"http://127.0.0.1:{port}").read_text()
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stderr.strip() == (
            f"lightning-ppo serve: error: lightning-ppo serve --port {port}: 127.0.0.1:{port} is in use "
            "(a server already runs there?)"
        ), second.stderr
        assert key_file(f"http://127.0.0.1:{port}").read_text() == key
    finally:
        first.kill()
        first.wait(30)


def test_vllm_api_key_is_enough_where_no_home_folder_can_be_named(monkeypatch):
    """A container's uid without a passwd entry or HOME: Path.home() raises. With VLLM_API_KEY set
    the trainer needs no key folder (it looked for the key file first, and raised); without it the
    error is one line saying what to set."""

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    assert server_key("http://127.0.0.1:8000").value == "k3y"
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(UsageError, match="no home folder to keep server keys in: set XDG_CACHE_HOME"):
        server_key("http://127.0.0.1:8000")


def test_serve_with_vllm_api_key_starts_where_no_home_folder_can_be_named(monkeypatch):
    """The server's side of the same container: ``serve`` with VLLM_API_KEY (or --no-api-key) writes
    no key file, so it needs no key folder. Before, removing an earlier key file named the folder
    and refused in one line telling the user to set VLLM_API_KEY, which was set."""

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    claim_address("127.0.0.1", 8000)
    assert server_key_for("127.0.0.1", 8000, keyless=False)[0] == {}
    assert server_key_for("127.0.0.1", 8000, keyless=True)[0] == {}


def test_a_local_server_that_never_started_leaves_the_running_servers_key_file(
    keys, serve, monkeypatch, tmp_path
):
    """A ``LocalServer`` given the port of a running server (its free port taken meanwhile): its
    ``serve`` is refused and exits, ``wait_ready`` says so (before, the running server's /health
    answered and it was taken for this one's), and ``stop`` leaves the running server's key file
    alone (before, it removed it: the trainer then had no key for that server). A server that did
    start removes its own key file when stopped."""
    running = serve()
    path = key_file(running.url)
    key = path.read_text()
    monkeypatch.setattr(local_server, "free_port", lambda: running.port)
    env = {"PYTHONPATH": f"{tmp_path / 'shim'}:{ROOT}"}
    late = LocalServer(tmp_path / "policy", tmp_path / "late.log", env=env, start_timeout=120)
    try:
        with pytest.raises(RuntimeError, match=f"the server for {running.url} exited"):
            late.wait_ready()
    finally:
        late.stop()
    assert path.read_text() == key
    assert ServerClient(running.url, 30).rpc("lppo_version") == "none"
    running.stop()
    assert not path.exists()


def test_a_local_server_keeping_its_keys_elsewhere_is_ready_and_removes_its_own(keys, tmp_path):
    """A ``LocalServer`` whose environment names another key folder (``env={"XDG_CACHE_HOME": ...}``)
    than this process's: its ``serve`` holds the lock there, which is still its own (it was looked
    for in this process's folder only, and the server never counted as ready); its key file, written
    there, is removed by ``stop``."""
    elsewhere = tmp_path / "elsewhere"
    env = {"PYTHONPATH": f"{tmp_path / 'shim'}:{ROOT}", "XDG_CACHE_HOME": str(elsewhere)}
    shim = tmp_path / "shim" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    (shim / "api_server.py").write_text("from tests.fake_vllm_server import main\n\nmain()\n")
    (tmp_path / "policy").mkdir()
    server = LocalServer(tmp_path / "policy", tmp_path / "serve.log", env=env, start_timeout=60)
    try:
        server.wait_ready()
        written = elsewhere / "lightning_ppo" / "server_keys" / key_file(server.url).name
        assert written.exists() and not key_file(server.url).exists()
    finally:
        server.stop()
    assert not written.exists()


class _Healthy(http.server.BaseHTTPRequestHandler):
    """Any HTTP server whose ``/health`` answers 200 (another program's, not a ``serve``)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_local_server_whose_port_another_program_took_is_not_ready(keys, tmp_path):
    """Another program (not a ``serve``: no lock of its own) takes the ``LocalServer``'s port after
    its ``serve`` found it free, while vLLM imports (seconds, before it binds): the other's /health
    answered and this one's ``serve`` held its lock, so it was taken as ready (the trainer then
    talked to the other program) until its server failed to bind and exited. Now a server is ready
    only once its own process listens on its port: ``wait_ready`` says it exited."""
    shim = tmp_path / "slow" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    started = tmp_path / "started"  # the server's shim says when it runs (serve's checks passed)
    (shim / "api_server.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "time.sleep(5)  # vLLM's imports, before it binds its port\n"
        "from tests.fake_vllm_server import main\n\nmain()\n"
    )
    (tmp_path / "policy").mkdir()
    env = {"PYTHONPATH": f"{tmp_path / 'slow'}:{ROOT}"}
    server = LocalServer(tmp_path / "policy", tmp_path / "serve.log", env=env, start_timeout=120)
    other = None
    try:
        for _ in range(600):  # at most 60 s
            if started.exists() or server.process.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists()
        other = http.server.HTTPServer(("127.0.0.1", server.port), _Healthy)
        threading.Thread(target=other.serve_forever, daemon=True).start()
        with pytest.raises(RuntimeError, match=f"the server for {server.url} exited"):
            server.wait_ready()
    finally:
        server.stop()
        if other is not None:
            other.shutdown()
            other.server_close()
    assert not key_file(server.url).exists()


def test_ctrl_c_while_a_local_server_starts_stops_it(keys, tmp_path):
    """Ctrl-C while ``wait_ready`` waits (a notebook's user, tired of a slow start): the server, in a
    session of its own (the terminal's Ctrl-C does not reach it), ran on, holding its memory and
    its key file, with nothing left to stop it (``with LocalServer(...)`` calls ``wait_ready`` in
    ``__enter__``, so ``__exit__`` never ran). Now ``wait_ready`` stops it on its way out, as it
    does when it gives up, and its key file goes with it."""
    shim = tmp_path / "slow" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    started = tmp_path / "started"
    (shim / "api_server.py").write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(120)\n"
    )
    (tmp_path / "policy").mkdir()
    env = {"PYTHONPATH": f"{tmp_path / 'slow'}:{ROOT}"}
    server = LocalServer(tmp_path / "policy", tmp_path / "serve.log", env=env, start_timeout=120)
    try:
        for _ in range(600):  # at most 60 s
            if started.exists() or server.process.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists() and key_file(server.url).exists()
        interrupt = threading.Timer(1.0, _thread.interrupt_main)  # as a Ctrl-C on this thread
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            server.wait_ready()
        interrupt.join()
        assert server.process.poll() is not None
        assert not key_file(server.url).exists()
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_local_server_in_a_pid_namespace_without_its_own_proc_is_ready(keys, tmp_path):
    """A trainer in a PID namespace of its own whose ``/proc`` is still the parent's (``unshare
    --pid --fork`` without ``--mount-proc``, some sandboxes): its child's PID, looked up there, is
    another process, which neither listens on the server's port nor holds its lock, so the server
    was never ready (TimeoutError). ``/proc`` is read only where it shows this process as itself;
    elsewhere the server is ready once ``/health`` answers, as where there is no ``/proc``."""
    shim = tmp_path / "shim" / "vllm" / "entrypoints" / "openai"
    shim.mkdir(parents=True)
    for folder in (shim, shim.parent, shim.parent.parent):
        (folder / "__init__.py").write_text("")
    (shim / "api_server.py").write_text("from tests.fake_vllm_server import main\n\nmain()\n")
    (tmp_path / "policy").mkdir()
    script = tmp_path / "start.py"
    script.write_text(
        "import sys\n"
        "from lightning_ppo.rollout.engines.server.local_server import LocalServer\n"
        f"env = {{'PYTHONPATH': {str(tmp_path / 'shim') + ':' + str(ROOT)!r}}}\n"
        f"server = LocalServer({str(tmp_path / 'policy')!r}, {str(tmp_path / 'serve.log')!r}, env=env, "
        "start_timeout=30)\n"
        "try:\n    server.wait_ready()\n    print('ready')\nfinally:\n    server.stop()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ["unshare", "--pid", "--fork", sys.executable, str(script)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if "unshare failed" in run.stderr:  # not allowed here (no CAP_SYS_ADMIN, no user namespaces)
        pytest.skip(run.stderr.strip())
    assert run.stdout.strip() == "ready", run.stderr[-2000:]
