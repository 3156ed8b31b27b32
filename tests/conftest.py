"""Shared fixtures: tiny real checkpoints written with save_pretrained and loaded by path."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's on-disk cache does not key its kernels on the CPU capability: a run under
# ATEN_CPU_CAPABILITY=default (make test-numerics) reused an AVX-512 run's kernels and failed to
# build them (or crashed, under avx2). Each capability asked for compiles into a folder of its own.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    folder = f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), folder))

from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 64 GPT-2 with a char-level tokenizer (pad != eos)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gpt2"), TinyModelSpec(n_layer=2, n_embd=64))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 64 Llama-style model with the same tokenizer."""
    spec = TinyModelSpec(arch="llama", n_layer=2, n_embd=64)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), spec)


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's checkpoint: a 2 x 64 GPT-2 over a 14-token digit vocabulary."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_digits"), TinyModelSpec(), alphabet="0123456789="
    )


@pytest.fixture(scope="session")
def tiny_reward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random one-output GPT-2 classifier with its own tokenizer (the digit vocabulary)."""
    out = tmp_path_factory.mktemp("tiny_reward")
    return make_tiny_checkpoint(out, TinyModelSpec(n_embd=32), alphabet="0123456789=", seed=1, kind="reward")


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs (needs root and mount rights; skipped without them)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


# ----------------------------------------------------------------- running on several workers
# `make test` runs the suite on pytest-xdist workers (`--dist loadgroup`). A test marked `ranks`
# starts several processes (DDP, FSDP2, two nodes): they all go to one worker, one after another,
# so no two of them share the cores at once (4 ranks on 2 cores would slow both past their
# timeouts); the other workers go on with the rest beside it. Most start their ranks together,
# forked from processes that have done the imports (tests.helpers.start_ranks, tests/zygote.py);
# the tests of a launcher (Lightning's, torchrun) start them as a user does.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("ranks") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))


@pytest.fixture(autouse=True)
def _ctrl_c_raises_in_every_test():
    """Ctrl-C raises KeyboardInterrupt in every test, as in an interpreter started in a terminal.
    `make test` run as a background job (`make test &`, nohup) starts with SIGINT ignored, which
    Python leaves ignored: four Ctrl-C tests then saw no KeyboardInterrupt (one waited 121 s). And
    Lightning's fit, stopped by a KeyboardInterrupt, sets SIGINT to SIG_IGN for its shutdown and
    leaves it so for the tests after it on the same worker."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(autouse=True)
def _says_whether_it_starts_ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests.helpers.start_cli refuses several ranks from a test not marked ``ranks``."""
    marked = request.node.get_closest_marker("ranks") is not None
    monkeypatch.setenv("LIGHTNING_PPO_TEST_RANKS", "1" if marked else "0")
