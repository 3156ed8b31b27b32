"""A ``lightning-ppo serve`` server on this machine, as a child process: for notebooks, tests and
benchmarks that want a generation server without a second terminal.

    with LocalServer("checkpoints/tiny-digits") as server:
        GenerationConfig(engine="vllm_server", server_urls=[server.url])

It listens on 127.0.0.1 only, on a free port, with the API key ``serve`` makes where
``VLLM_API_KEY`` is unset (the trainer in this process reads it from the key file ``serve``
writes); :meth:`wait_ready` polls ``/health`` for at most ``start_timeout`` seconds; :meth:`stop`
kills its whole process group (the API server, its engine core and worker), so nothing outlives
it, and removes its key file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from lightning_ppo.rollout.engines.server.client import ServerClient
from lightning_ppo.runs.server_keys import forget_keys


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
        does not answer within ``start_timeout`` seconds."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server for {self.url} exited: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.stop()
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
        """SIGKILL to the server's process group; waits for the server to be gone."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)
        forget_keys("127.0.0.1", self.port)  # a dead server's key guards nothing

    def _log_tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> LocalServer:
        return self.wait_ready()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()
