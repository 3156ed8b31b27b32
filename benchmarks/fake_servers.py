"""Fake generation servers for benchmarks of the server engine's routing: each answers a
completion after a fixed service time, however many it holds at once (a server whose batch never
fills), with ``n`` samples of ``tokens`` token ids; no vLLM, no model.

    with FakeServers([0.5, 0.5, 2.0]) as servers:
        ...  # generation.server_urls: servers.urls; servers.peaks(): each one's most in flight

They run in a process of their own (``python -m benchmarks.fake_servers``: aiohttp and nothing
heavier, so no garbage collection over a trainer's objects slows their answers), on one event loop,
on 127.0.0.1, pinned to ``cores``; stopped on leaving the ``with``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import TracebackType

from aiohttp import web

from benchmarks.flags import at_least_one

ROOT = Path(__file__).resolve().parents[1]


class FakeServers:
    """A server per entry of ``service_s`` (its seconds per request), on free ports of 127.0.0.1."""

    def __init__(self, service_s: list[float], tokens: int = 16, cores: str = "1") -> None:
        command = ["taskset", "-c", cores, sys.executable, "-m", "benchmarks.fake_servers"]
        command += ["--service", ",".join(map(str, service_s)), "--tokens", str(tokens)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.urls: list[str] = []

    def __enter__(self) -> FakeServers:
        assert self.process.stdout is not None
        self.urls = self.process.stdout.readline().split()
        if not self.urls:
            self.process.kill()
            raise RuntimeError("the fake servers did not start")
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.process.kill()
        self.process.wait(60)

    def peaks(self) -> list[int]:
        """Each server's most requests in flight at once since the last call (which resets them)."""
        peaks = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/peak", timeout=30) as answer:
                peaks.append(int(answer.read()))
        return peaks


class _Server:
    """One fake server: its service time, its requests in flight now and at most."""

    def __init__(self, service_s: float, tokens: int) -> None:
        self.service_s = service_s
        self.tokens = tokens
        self.in_flight = 0
        self.peak = 0

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.in_flight -= 1
        choice = {"token_ids": [3] * self.tokens, "logprobs": {"token_logprobs": [-0.5] * self.tokens}}
        choices = [{**choice, "index": i} for i in range(body["n"])]
        return web.Response(text=json.dumps({"choices": choices}), content_type="application/json")

    async def take_peak(self, request: web.Request) -> web.Response:
        peak, self.peak = self.peak, self.in_flight
        return web.Response(text=str(peak))


async def _serve(service_s: list[float], tokens: int) -> None:
    urls = []
    for seconds in service_s:
        server = _Server(seconds, tokens)
        app = web.Application()
        app.router.add_post("/v1/completions", server.complete)
        app.router.add_get("/peak", server.take_peak)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=4096).start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    print(" ".join(urls), flush=True)
    await asyncio.Event().wait()  # until killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", required=True, help="Seconds per request of each server, by commas.")
    parser.add_argument("--tokens", type=at_least_one, default=16)
    args = parser.parse_args()
    asyncio.run(_serve([float(s) for s in args.service.split(",")], args.tokens))


if __name__ == "__main__":
    main()
