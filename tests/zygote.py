"""A process that has imported what ``python -m lightning_ppo.cli`` imports and forks a copy of itself
for each command a test runs (``tests.helpers.start_forked``): a new process, with its own pid,
stdin/stdout/stderr, environment, exit status and signals, without the ~5 s of one core that
importing torch, Lightning and transformers costs every new interpreter.

Started by the client as ``python -m tests.zygote FD LOG`` with one end of a ``SOCK_SEQPACKET``
socket pair as FD. Each request is one message, JSON with the stdio and a status socket attached as
file descriptors: ``{"entry", "argv", "env", "cwd", "session", "interruptible"}``. The zygote forks;
the child becomes ``python -m ENTRY ARGV`` (``runpy``, as ``-m`` does) with exactly ``env``; the
zygote writes the child's pid, then, once it has reaped it, its status (a ``subprocess`` return code:
negative for a signal) to the status socket. When the client goes away, the children still running
are killed; a ``{"retire": true}`` request instead ends the zygote once its last child has ended.

Only what is the same in every fresh interpreter is shared: the modules (imported with the
environment the client started the zygote with; the client sends only commands whose environment
differs from that one in variables read at run time, see ``RUN_TIME_VARIABLES``), nothing run.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
from pathlib import Path

# Variables a command's environment may set differently from the zygote's: none is read at import
# time by the modules imported here, or they are read again in the child (rank_zero_only's rank,
# tempfile's folder). PYTEST_CURRENT_TEST changes with every test; the seeds, tokenizers' switch and
# inductor's pointer are what in-process tests leave in the test process's environment; vLLM is
# not imported here.
RUN_TIME_VARIABLES = frozenset(
    {
        "LOCAL_RANK",
        "NODE_RANK",
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TMPDIR",
        "LIGHTNING_PPO_TEST_RANKS",
        "LIGHTNING_PPO_VERBOSE",
        "PYTEST_CURRENT_TEST",
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
        "TOKENIZERS_PARALLELISM",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        # wandb's, read by wandb.init, not at import (0.17.2 and 0.31 alike; 0.17.2 reads WANDB_DIR
        # and others at import: the rest stay in the key). WANDB_SERVICE is what an in-process
        # wandb.init leaves in the test process's environment for good.
        "WANDB_MODE",
        "WANDB_SERVICE",
    }
)
RUN_TIME_PREFIXES = ("VLLM_",)

# What parsing a config that names the WandbLogger (11 of the 14 in configs/) imports besides: jsonargparse
# runs the `if TYPE_CHECKING:` imports of Lightning's loggers/wandb.py to resolve its hints, ~400
# modules and 0.6 s of one core in every forked run (every rank) that a new interpreter pays too.
# Imported with the child's own WANDB_ variables: those wandb may read at import are part of a zygote's key.
CONFIG_IMPORTS = ["wandb", "wandb.sdk.lib", "wandb.wandb_run"]


def read_at_run_time(name: str) -> bool:
    """Whether a command may set ``name`` differently from the zygote's environment."""
    return name in RUN_TIME_VARIABLES or name.startswith(RUN_TIME_PREFIXES)


def preload() -> tuple[bytes, bytes]:
    """Import the modules ``lightning_ppo/cli.py`` imports at its top (not the CLI module itself:
    under ``python -m`` it is ``__main__``, run afresh in each child). What the imports print (a
    library's warning, say) is returned, stdout's and stderr's: each child prints it first, as a new
    interpreter would."""
    source = Path(__file__).resolve().parents[1] / "lightning_ppo" / "cli.py"
    names = []
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    names += CONFIG_IMPORTS
    saved = [os.dup(1), os.dup(2)]
    captured = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    for fd, file in zip((1, 2), captured, strict=True):
        os.dup2(file.fileno(), fd)
    try:
        for name in names:
            if name != "__future__":
                importlib.import_module(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
    printed = []
    for file in captured:
        file.seek(0)
        printed.append(file.read())
        file.close()
    os.write(2, printed[1])  # into the zygote's log too
    return printed[0], printed[1]


def run_child(request: dict, fds: list[int], keep: list[int], printed: tuple[bytes, bytes]) -> None:
    """In the forked child: become ``python -m ENTRY ARGV``; never returns."""
    code = 1
    try:
        for fd in keep:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request["session"]:
            os.setsid()
        else:  # a group of its own, so that a kill reaches what it started too (Lightning's rank 1)
            _own_group(0)
        if request["interruptible"]:  # Python's own Ctrl-C handler, even if SIGINT came in ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds[:3], strict=True):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for fd, data in zip((1, 2), printed, strict=True):
            os.write(fd, data)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_module(request["entry"], request["argv"])
    finally:
        os._exit(code)


def _run_module(entry: str, argv: list[str]) -> int:
    """``python -m ENTRY ARGV`` in this process: the exit status an interpreter would end with."""
    import atexit
    import runpy
    import threading

    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    tempfile.tempdir = None  # chosen again from this environment's TMPDIR
    rank_zero_only.rank = _get_rank() or 0  # as Lightning sets it on import, from LOCAL_RANK & co.
    sys.argv = [entry, *argv]  # runpy puts the module's path first, as -m does
    code = 0
    try:
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # what an interpreter does on its way out: wait for its threads, run atexit, flush
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 (a closed or broken stream: nothing more to say)
            pass
    if code < 0:  # an uncaught KeyboardInterrupt: Python ends by the signal itself
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF


def serve(control: socket.socket, printed: tuple[bytes, bytes]) -> None:
    children: dict[int, socket.socket] = {}
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    client_gone = False
    while not client_gone or children:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 8)
                if not message:
                    client_gone = True
                    selector.unregister(control)
                    for pid in children:
                        kill_group(pid)
                    continue
                request = json.loads(message)
                if request.get("retire"):  # replaced (the package's code changed): end with the last child
                    client_gone = True
                    selector.unregister(control)
                    continue
                status = socket.socket(fileno=fds[3])
                pid = os.fork()
                if pid == 0:
                    keep = [control.fileno(), wake_read, wake_write, selector.fileno(), status.fileno()]
                    keep += [s.fileno() for s in children.values()]
                    run_child(request, fds[:3], keep, printed)
                if not request["session"]:  # also here: the client may kill the group before the child runs
                    _own_group(pid)
                for fd in fds[:3]:
                    os.close(fd)
                children[pid] = status
                _send(status, {"pid": pid})
            else:
                while True:
                    try:
                        os.read(wake_read, 512)
                    except BlockingIOError:
                        break
        while children:
            pid, status_code = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            status = children.pop(pid)
            _send(status, {"returncode": os.waitstatus_to_exitcode(status_code)})
            status.close()


def _send(status: socket.socket, message: dict) -> None:
    try:
        status.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client closed its end: it no longer waits for this child
        pass


def _own_group(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of a process group of its own; the zygote and the
    child both call it (as a shell does), whichever runs first wins and the other finds it done."""
    try:
        os.setpgid(pid, 0)
    except (PermissionError, ProcessLookupError):  # the child already ran (exec'd, ended or set it)
        pass


def kill_group(pid: int) -> None:
    """SIGKILL a forked child and every process in its group (the ranks or servers it started)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), preload())
    log = Path(sys.argv[2])
    if log.is_file() and log.stat().st_size == 0:  # nothing went wrong: no trace left in the temp folder
        log.unlink()
