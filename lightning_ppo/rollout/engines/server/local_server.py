"""A ``lightning-ppo serve`` server on this machine, as a child process: for notebooks, tests and
benchmarks that want a generation server without a second terminal.

    with LocalServer("checkpoints/tiny-digits") as server:
        GenerationConfig(engine="vllm_server", server_urls=[server.url])

It listens on 127.0.0.1 only, on a free port, with the API key ``serve`` makes where
``VLLM_API_KEY`` is unset (the trainer in this process reads it from the key file ``serve``
writes); :meth:`wait_ready` polls ``/health`` for at most ``start_timeout`` seconds; :meth:`stop`
kills its whole process group (the API server, its engine core and worker), so nothing outlives
it, and removes its key file: only the one its own ``serve`` wrote. The free port is chosen before
the server binds it, so another program may take it meanwhile (another server, before this one's
``serve`` checks it or while vLLM imports); this one's server then fails to bind and exits, and
the ``/health`` that answers at that address is the other's. So a server is ready only once its
own process (or one of its children) listens on its port (Linux's ``/proc``; where that cannot be
told, no ``/proc`` or another PID namespace's, once ``/health`` answers). Which key file is its
own is told by the address's lock (``runs.server_keys.claim_address``), which the ``serve`` that
runs there holds open: the key file beside that lock is the only one :meth:`stop` removes (same
file, same key).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from lightning_ppo.rollout.engines.server.client import ServerClient
from lightning_ppo.runs.server_keys import key_names, lock_name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """``lightning-ppo serve --policy POLICY`` on 127.0.0.1; its output in ``log``.

    ``env`` is added to the server's environment: on CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default
    1 here: vLLM's own default takes most of the machine's memory and a minute to allocate).
    ``cpus`` pins every process of the server to those CPU cores (Linux), its API server and engine
    core included (``VLLM_CPU_OMP_THREADS_BIND`` pins only the worker's threads). ``serve_args`` go
    to ``lightning-ppo serve`` itself (``--no-api-key``).
    """

    def __init__(
        self,
        policy: str | Path,
        log: str | Path | None = None,
        dtype: str = "auto",
        vllm_args: tuple[str, ...] = ("--enforce-eager",),
        env: dict[str, str] | None = None,
        start_timeout: float = 240.0,
        cpus: set[int] | None = None,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log) if log is not None else Path(os.devnull)
        self.start_timeout = start_timeout
        self.key_path: Path | None = None  # the key file this server's serve wrote (_note_key)
        self.key_written: KeyFile | None = None  # and what it was then
        environment = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {})}
        command = [sys.executable, "-m", "lightning_ppo.console", "serve", "--policy", str(policy)]
        command += ["--port", str(self.port), "--dtype", dtype, *serve_args, "--", *vllm_args]
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )

    def wait_ready(self) -> LocalServer:
        """Return once the server answers ``/health``; an error with the log's end if it exits or
        does not answer within ``start_timeout`` seconds. Whatever ends the wait otherwise (Ctrl-C
        included) stops the server: it runs in a session of its own, which a terminal's Ctrl-C does
        not reach, and ``with LocalServer(...)`` waits in ``__enter__``, so ``__exit__`` would not."""
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> LocalServer:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server for {self.url} exited: {self._log_tail()}")
            self._note_key()  # while its process runs: a server that exits unready wrote one too
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    answered = answer.status == 200
            except OSError:
                answered = False
            # this server's answer, or another program's on a port it took meanwhile?
            if answered and _listens(self.process.pid, self.port) is not False:
                return self
            time.sleep(1 if not answered else 0.2)
        raise TimeoutError(
            f"{self.url} did not answer /health in {self.start_timeout:g} s: {self._log_tail()}"
        )

    def completed(self) -> float:
        """Requests the server has finished (its Prometheus counter)."""
        request = urllib.request.Request(
            self.url + "/metrics", headers=ServerClient(self.url, 10).auth_headers()
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            lines = answer.read().decode().splitlines()
        return sum(
            float(line.split()[-1]) for line in lines if line.startswith("vllm:request_success_total{")
        )

    def stop(self) -> None:
        """SIGKILL to the server's process group; waits for the server to be gone. Its key file is
        removed (a dead server's key guards nothing) where this server's ``serve`` wrote it and it
        was not written again since; another server's, at a port it took, is left alone."""
        if self.process.poll() is None:
            self._note_key()
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)
        path, written = self.key_path, self.key_written
        if path is not None and written is not None and KeyFile.read(path) == written:
            path.unlink(missing_ok=True)

    def _note_key(self) -> bool | None:
        """Whether this server's own process holds its address's lock (``None``: this system cannot
        tell); if so, the key file beside the lock (its ``serve`` wrote it: the folder is the one the
        server's environment names) is noted for :meth:`stop`."""
        held = _open_files(self.process.pid)
        if held is None:
            return None
        lock = next((path for path in held if path.name == lock_name("127.0.0.1", self.port)), None)
        if lock is None:
            return False
        self.key_path = lock.with_name(key_names("127.0.0.1", self.port)[0])
        self.key_written = KeyFile.read(self.key_path)
        return True

    def _log_tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> LocalServer:
        return self.wait_ready()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()


@dataclass(frozen=True)
class KeyFile:
    """A key file as it is now: the file itself (device and inode, a replaced file is another one)
    and the key it holds."""

    device: int
    inode: int
    key: str

    @staticmethod
    def read(path: Path) -> KeyFile | None:
        try:
            with open(path) as file:
                info = os.fstat(file.fileno())
                return KeyFile(info.st_dev, info.st_ino, file.read())
        except OSError:
            return None


def _open_files(pid: int) -> list[Path] | None:
    """The files process ``pid`` has open (Linux: ``/proc/PID/fd``; none once it is gone); ``None``
    where this system cannot tell."""
    if not _proc_is_ours():
        return None
    try:
        descriptors = list(Path("/proc", str(pid), "fd").iterdir())
    except PermissionError:  # another user's, or a /proc mounted to hide them
        return None
    except OSError:  # the process is gone
        return []
    files = []
    for descriptor in descriptors:
        try:
            files.append(Path(os.readlink(descriptor)))
        except OSError:  # closed as it was listed
            continue
    return files


def _proc_is_ours() -> bool:
    """``/proc`` is Linux's and shows this process's PID namespace: a process that moved into a
    namespace of its own without mounting its ``/proc`` (``unshare --pid --fork``, some sandboxes)
    sees the parent's there, where a child's PID is another process."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` or one of its children holds a socket listening on ``port`` (its own
    network's TCP tables, by socket inode: vLLM's API server binds it, and may hand it to children);
    ``None`` where this system cannot tell."""
    inodes: set[str] = set()
    for process in _with_children(pid):
        files = _open_files(process)
        if files is None:
            return None
        inodes |= {str(file)[len("socket:[") : -1] for file in files if str(file).startswith("socket:[")}
    tables = [Path("/proc", str(pid), "net", name) for name in ("tcp", "tcp6")]
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except PermissionError:
            return None
        except OSError:  # no IPv6 here, or the process is gone
            continue
        for fields in (line.split() for line in lines):  # sl, local, remote, state, ..., inode (10th)
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                return True
    return False


def _with_children(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/TID/children``, where the kernel keeps it)."""
    found, queue = [], [pid]
    while queue and len(found) < 1000:
        process = queue.pop()
        found.append(process)
        for children in Path("/proc", str(process), "task").glob("*/children"):
            try:
                queue += [int(child) for child in children.read_text().split()]
            except (OSError, ValueError):  # gone as it was read
                continue
    return found
