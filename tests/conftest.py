"""Shared fixtures: tiny real checkpoints written with save_pretrained and loaded by path."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
# `make test` runs the suite on pytest-xdist workers, one per core. A test marked `ranks` starts
# several processes (DDP, FSDP2, two nodes); it runs alone, so its ranks get the cores they expect
# and no timeout in it fires because another worker took a core. Every other test holds a shared
# lock, a `ranks` test an exclusive one; a turnstile in front keeps a waiting `ranks` test from
# being starved by the shared holders taking turns.
_XDIST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")


@pytest.fixture(autouse=True)
def _ranks_run_alone(request: pytest.FixtureRequest):
    if _XDIST_RUN is None:
        yield
        return
    alone = request.node.get_closest_marker("ranks") is not None
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    with open(folder / f"lightning_ppo-{_XDIST_RUN}.turnstile", "a") as turnstile:
        with open(folder / f"lightning_ppo-{_XDIST_RUN}.lock", "a") as lock:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            os.environ["LIGHTNING_PPO_TEST_ALONE"] = "1" if alone else "0"
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
