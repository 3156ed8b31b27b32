"""A process that ends while a weights group is being let go (``lightning_ppo/rollout/engines/server/
let_go.py``): the let-go thread, in the group's destructor (the GIL released), took the GIL back
as the interpreter finalized, and Python's ``pthread_exit`` unwinding through the destructor was
``std::terminate``: exit status 134 (SIGABRT), "terminate called without an active exception",
in place of the process's own error and status. Each case runs in a new interpreter (a process
forked from the test zygote ends with ``os._exit``, which never finalizes); groups on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.helpers import communicate, quickstart_fit_args, start_cli
from tests.test_server_engine import _Backlogged
from tests.test_server_failures import _Serving, _Worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo on 127.0.0.1, Linux's exit")
ROOT = Path(__file__).resolve().parents[1]

_SYNCED_THEN_LET_GO = """
from tests.test_weight_group_fork import _expected, _pair, _synced
zero, one = _pair()
assert _synced(zero, one, "run/1", 2.0) == _expected(2.0)
zero.let_go()
one.let_go()
"""

# Rank 1 takes the first bucket's header, then hangs (a server frozen in its load): rank 0's
# broadcast of the 64 MB tensor is pending when its own weights fail, until the group's timeout
# (120 s); "dies": rank 1 lets go too as the script ends (the server killed with the trainer).
_STOPPED_WITH_A_BROADCAST_PENDING = """
import sys, threading, time
import torch
from lightning_ppo.rollout.engines.server.weight_group import _broadcast, listening_socket, open_group, send
listener = listening_socket("127.0.0.1")
port, joined = listener.getsockname()[1], []
peer = threading.Thread(target=lambda: joined.append(open_group("127.0.0.1", port, 1, 2, 120, "127.0.0.1")))
peer.start()
zero = open_group("127.0.0.1", port, 0, 2, 120, "127.0.0.1", listener=listener)
peer.join(30)
one = joined[0]

def frozen():
    length = _broadcast(one, torch.zeros(1, dtype=torch.int64), lambda: None)
    _broadcast(one, torch.empty(int(length), dtype=torch.uint8), lambda: None)

threading.Thread(target=frozen, daemon=True).start()

def weights():
    yield "a", torch.ones(16 * 2**20)
    yield "b", torch.ones(1)
    time.sleep(0.5)
    raise RuntimeError("the trainer's gather failed")

try:
    send(zero, weights(), "run/1", bucket_bytes=2**20)
finally:
    zero.let_go()
    if sys.argv[1:] == ["dies"]:
        one.let_go()
"""

# A server's worker, its receiving thread waiting for rank 0's first bucket (rank 0 sends nothing
# yet), and the server's process ends (stopped with its trainer).
_ENDED_WHILE_RECEIVING = """
from lightning_ppo.rollout.engines.server.weight_group import receive
from tests.test_weight_group_fork import _pair
zero, one = _pair()
receiver = receive(one, "run/1")
assert not receiver.ended.wait(0.5)
"""


def _script(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run as a script in a new interpreter; bounded far below the groups' timeout (120 s):
    an exit that waited for the pending broadcast would not end within it."""
    (tmp_path / "script.py").write_text(textwrap.dedent(code))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [sys.executable, str(tmp_path / "script.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = communicate(process, 60)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_a_script_that_ends_just_after_a_sync_and_its_let_go_ends_with_status_0(tmp_path):
    done = _script(tmp_path, _SYNCED_THEN_LET_GO)
    assert "terminate called" not in done.stderr
    assert done.returncode == 0


@pytest.mark.parametrize("peer", ["frozen", pytest.param("dies", marks=pytest.mark.long)])  # 6 s each
def test_a_script_whose_sync_stopped_with_a_broadcast_pending_ends_with_its_own_error(tmp_path, peer):
    done = _script(tmp_path, _STOPPED_WITH_A_BROADCAST_PENDING, peer)
    assert done.stderr.strip().splitlines()[-1] == "RuntimeError: the trainer's gather failed"
    assert done.returncode == 1


def test_a_server_that_ends_while_its_receiving_thread_waits_for_rank_zero_ends_with_status_0(tmp_path):
    """The receiving thread (a daemon) took the GIL back from gloo's wait as the interpreter finalized:
    exit status 134 (SIGABRT) in 3 of 3 runs before; 0 now."""
    done = _script(tmp_path, _ENDED_WHILE_RECEIVING)
    assert "terminate called" not in done.stderr
    assert done.returncode == 0


class _Described(_Worker):
    """A worker around a Hugging Face model that describes it as ``lightning-ppo serve``'s does."""

    def __init__(self, model: torch.nn.Module, policy: Path) -> None:
        super().__init__(model)
        config = model.config
        self.model_runner.model_config = SimpleNamespace(
            model=str(policy),
            hf_config=config,
            get_vocab_size=lambda: config.vocab_size,
            dtype=torch.float32,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
        )


class _Frozen(_Described):
    """A server frozen in the sync (it reads none of the weights) until it dies (``dies`` set)."""

    def __init__(self, model: torch.nn.Module, policy: Path) -> None:
        super().__init__(model, policy)
        self.receiving, self.dies = threading.Event(), threading.Event()

    def lppo_receive(self, with_checksums: str = "1", version: str = "", secret: str = "") -> None:
        self.receiving.set()
        self.dies.wait(120)
        self._lppo_let_go()  # its pairs close, as a killed server's do
        raise RuntimeError("killed")


class _Server(_Serving):
    """``/v1/models``, ``/tokenize`` (the policy's tokenizer) and ``/collective_rpc``."""

    tokenizer = None

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.reply(json.dumps({"data": [{"id": "policy"}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/tokenize":
            super().do_POST()
            return
        prompt = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))["prompt"]
        tokens = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.reply(json.dumps({"tokens": tokens}).encode())


@pytest.mark.long  # 10-20 s: the CLI end to end; the scripts above prove the exit in make test
def test_ctrl_c_during_a_sync_to_a_frozen_server_that_dies_after_ends_with_status_130(tmp_path, monkeypatch):
    """``lightning-ppo fit``, its first in-memory sync to a server frozen in it (rank 0's broadcast
    of the 50 MB policy pending), Ctrl-C, and the server killed 0.7 s later (as Ctrl-C in a terminal
    kills both): the let-go thread's destructor returned as the interpreter finalized, exit status
    -6 (SIGABRT) in 5 of 5 runs at 0.5-1.0 s (130 at 0-0.2 s). Now 130 and the CLI's line, at any
    moment of the server's death."""
    from lightning_ppo.rollout.engines.server import worker_extension

    monkeypatch.setattr(worker_extension, "_repack_embedding_gemms", lambda model: None)
    policy = make_tiny_checkpoint(
        tmp_path / "policy", TinyModelSpec(n_layer=4, n_embd=512), alphabet="0123456789="
    )
    worker = _Frozen(AutoModelForCausalLM.from_pretrained(str(policy)), policy)
    handler = type(
        "Server",
        (_Server,),
        {
            "workers": [worker],
            "one_at_a_time": threading.Lock(),
            "tokenizer": AutoTokenizer.from_pretrained(str(policy)),
        },
    )
    server = _Backlogged(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    args = quickstart_fit_args(
        policy,
        tmp_path / "run",
        [],
        *("--trainer.limit_train_batches", "1", "--model.init_args.generation.engine", "vllm_server"),
        *("--model.init_args.generation.server_urls", json.dumps([url])),
        *("--model.init_args.generation.server_timeout", "120"),
        prompts=16,
    )
    process = start_cli(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.receiving.wait(120)
        time.sleep(1.0)  # rank 0 is in its broadcast
        process.send_signal(signal.SIGINT)
        time.sleep(0.7)
        worker.dies.set()
        _, stderr = communicate(process, 60)
    finally:
        worker.dies.set()
        if process.poll() is None:
            process.kill()
            process.wait(30)
        server.shutdown()
        server.server_close()
    assert "terminate called" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("lightning-ppo: interrupted (Ctrl-C)")
    assert process.returncode == 130


# The exit's handler runs between a let-go reading the exit's flag and registering its thread
# (another thread's let-go as the main thread ends): the interleaving forced by running the handler
# as the thread is made, between the two.
_EXIT_BETWEEN_CHECK_AND_REGISTER = """
import threading
from lightning_ppo.rollout.engines.server import let_go

class Handle:
    def __del__(self):
        print("destroyed", flush=True)

made = threading.Thread.__init__

def exit_begins_first(thread, *args, **kwargs):
    let_go._at_exit()
    made(thread, *args, **kwargs)

threading.Thread.__init__ = exit_begins_first
let_go.drop_later([Handle()], [], "let-go")
threading.Thread.__init__ = made
print("let go", flush=True)
"""


def test_a_let_go_as_the_exit_begins_keeps_its_handles(tmp_path):
    """Before: the let-go's thread, registered after the exit listed the threads to join, destroyed
    its handles unjoined (as the interpreter finalizes, in a real exit: SIGABRT with a gloo group)."""
    done = _script(tmp_path, _EXIT_BETWEEN_CHECK_AND_REGISTER)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["let", "go"]
