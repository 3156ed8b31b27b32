"""Importable test doubles selected by class_path in CLI tests (real classes, not mocks)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from lightning_ppo import PPOLightningModule, PromptDataModule
from lightning_ppo.distributed.sharded_checkpoint import AtomicModelParallelStrategy
from lightning_ppo.rewards import RewardFunction
from lightning_ppo.rollout.episodes import Environment, StepResult
from lightning_ppo.runs.checkpoint_io import AtomicCheckpointIO
from lightning_ppo.tasks.digits import DigitsReward

# 28 prompts of 4 characters ("012=", ...), for module tests on the char-tokenizer checkpoints.
PROMPTS = [f"{i}{i + 1}{i + 2}=" for i in range(7)] * 4


def prompt_data(batch_size: int = 8, prompts: list[str] = PROMPTS) -> PromptDataModule:
    return PromptDataModule(prompts=prompts, batch_size=batch_size, max_prompt_length=8)


class CountCharReward(RewardFunction):
    """Fraction of completion characters equal to ``char`` (0 for an empty completion)."""

    def __init__(self, char: str = "7") -> None:
        self.char = char

    def __call__(self, prompts, completions, batch):
        return [c.count(self.char) / max(len(c), 1) for c in completions]


# What the TRL-style rewards below received, one dict per call.
TRL_CALLS: list[dict[str, Any]] = []


def trl_answer_reward(prompts, completions, **kwargs):
    """Written as TRL's reward functions are: 1 where the completion starts with the ``answer`` column."""
    TRL_CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [float(c.startswith(a)) for c, a in zip(completions, kwargs["answer"], strict=True)]


def one_score_short(prompts, completions, batch):
    """A reward that returns one score fewer than there are completions."""
    return [0.0] * (len(completions) - 1)


def two_argument_reward(prompts, completions):
    """A reward whose signature fits neither calling convention (no batch, no **kwargs)."""
    return [0.0] * len(completions)


def exits_with_0(prompts, completions, batch):
    """A plain reward that ends the process as a script would (``sys.exit(0)``)."""
    sys.exit(0)


async def exits_with_0_async(prompts, completions, batch):
    """The same, ``async def``."""
    sys.exit(0)


def raises_keyboard_interrupt(prompts, completions, batch):
    """A plain reward raising what a Ctrl-C raises."""
    raise KeyboardInterrupt


class TRLLengthReward:
    """A TRL-style callable class that names the dataset column it needs."""

    def __call__(self, completions, answer, **kwargs):
        TRL_CALLS.append({"completions": completions, "answer": answer, **kwargs})
        return [-abs(len(c) - len(a)) for c, a in zip(completions, answer, strict=True)]


def trl_chat_reward(prompts, completions, completion_ids, answer, **kwargs):
    """A TRL reward on conversational data: ``prompts`` are message lists, each completion a list
    holding the assistant's message. 1 where the reply starts with the ``answer`` column."""
    TRL_CALLS.append(
        {"prompts": prompts, "completions": completions, "answer": answer, "ids": completion_ids}
    )
    return [float(c[0]["content"].startswith(a)) for c, a in zip(completions, answer, strict=True)]


def text_chat_reward(prompts, completions, batch):
    """Our convention on conversational data: the prompts as templated text, the messages beside them."""
    TRL_CALLS.append({"text": prompts, "completions": completions, "messages": batch.messages})
    return [0.0] * len(completions)


class ShortAnswerModule(PPOLightningModule):
    """A subclass with its own reward: 1 for a response of at most two characters, else 0.

    It records what ``score`` received so tests can check the batch carried the extra columns.
    """

    seen_extras: list[dict] = []

    def score(self, prompts, completions, batch):
        ShortAnswerModule.seen_extras.append(dict(batch.extras))
        return torch.tensor([1.0 if len(c) <= 2 else 0.0 for c in completions])


class NaNLossModule(PPOLightningModule):
    """Returns a NaN loss on the optimizer steps listed in ``nan_steps`` (counted from 0)."""

    def __init__(self, *args, nan_steps=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nan_steps = set(nan_steps)

    def ppo_loss(self, mb, *args):
        loss, stats = super().ppo_loss(mb, *args)
        self.loss_calls = getattr(self, "loss_calls", -1) + 1
        if self.loss_calls in self.nan_steps:
            loss = loss * float("nan")
        return loss, stats


class NaNFromIteration:
    """A reward that is fine until iteration ``start`` (by call count), then NaN for every sample."""

    def __init__(self, start: int = 2) -> None:
        self.start, self.calls = start, 0

    def __call__(self, prompts, completions, batch):
        self.calls += 1
        return [float("nan") if self.calls > self.start else 0.5] * len(completions)


class NaNOnRankZeroAtFirst(DigitsReward):
    """The digits reward, except that rank 0's first batch scores NaN throughout (a rank that alone
    has nothing to learn from in one iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, prompts, completions, batch):
        self.calls += 1
        scores = super().__call__(prompts, completions, batch)
        if self.calls == 1 and torch.distributed.get_rank() == 0:
            return torch.full_like(scores, float("nan"))
        return scores


class RankRecorder(Callback):
    """Writes, per rank, a checksum of the policy weights, the sampled completions and the state
    that steers training (KL coefficient, score moments) of every iteration to
    ``<out_dir>/rank<k>.json`` (for the DDP tests)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weights = torch.cat([p.detach().flatten().double() for p in pl_module.policy.parameters()])
        self.rows.append(
            {
                "checksum": float(
                    (weights * torch.arange(1, weights.numel() + 1, dtype=torch.float64)).sum()
                ),
                "completions": pl_module.last_samples.completions,
                "prompts": pl_module.last_samples.prompts,
                "scores_logged": float(trainer.callback_metrics["objective/scores"]),
                "kl_coef": pl_module.kl_ctl.value,
                "score_moments": pl_module.score_moments.state_dict(),
                "episode_tokens": float(trainer.callback_metrics.get("episode/tokens_mean", float("nan"))),
            }
        )
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.rows))


class TrainedWeightsRecorder(Callback):
    """For the FSDP2 tests: per rank, the longest completion of every iteration
    (``<out_dir>/lengths_rank<k>.json``) and, after training, the full trained weights in float64
    (``<out_dir>/weights_rank<k>.pt``), gathered from their shards under FSDP2."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.lengths: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lengths.append(max(len(c) for c in pl_module.last_samples.completions))
        path = Path(self.out_dir) / f"lengths_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.lengths))

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {}
        for name, p in pl_module.named_parameters():
            if p.requires_grad:  # full_tensor() is a collective: every rank gathers every weight
                full = p.full_tensor() if isinstance(p, DTensor) else p
                weights[name] = full.detach().double().cpu()
        torch.save(weights, Path(self.out_dir) / f"weights_rank{trainer.global_rank}.pt")


class RankPlacement(Callback):
    """Where Lightning placed this rank, as it sees it: ``<out_dir>/placement_rank<k>.json`` (k the
    global rank) with the node rank, local rank, world size and cluster environment (for the
    multi-node tests, which must show that their "nodes" really were nodes to Lightning)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module) -> None:
        placement = {
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "environment": type(trainer.strategy.cluster_environment).__name__,
        }
        path = Path(self.out_dir) / f"placement_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(placement))


class SlowToLoadReward(RewardFunction):
    """A reward that takes ``seconds`` to build, as a big reward model does to load, after writing
    ``started_file``: a test sends Ctrl-C in between (start-up, before the Trainer runs)."""

    def __init__(self, started_file: str, seconds: float = 60.0) -> None:
        Path(started_file).write_text("loading")
        time.sleep(seconds)

    def __call__(self, prompts, completions, batch):
        return [0.0] * len(completions)


class SlowSetup(Callback):
    """Takes ``seconds`` in ``setup`` (inside ``trainer.fit``, as sharding a big model or tokenizing
    a big prompt file does) after writing ``started_file``: a test sends Ctrl-C in between."""

    def __init__(self, started_file: str, seconds: float = 60.0) -> None:
        self.started_file, self.seconds = started_file, seconds

    def setup(self, trainer, pl_module, stage) -> None:
        Path(self.started_file).write_text("setting up")
        time.sleep(self.seconds)


class Throttle(Callback):
    """Sleeps after every iteration so that a test can interrupt a run mid-way; changes no result.

    With ``progress_file``, it writes there how many iterations this process has finished.
    """

    def __init__(self, seconds: float = 0.2, progress_file: str | None = None) -> None:
        self.seconds, self.progress_file, self.done = seconds, progress_file, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.done += 1
        if self.progress_file is not None:
            Path(self.progress_file).write_text(str(self.done))
        time.sleep(self.seconds)


def quiet_trainer(
    root, iterations: int, callbacks=(), plugins=(), precision="32-true", accelerator="cpu", epochs: int = 1
) -> pl.Trainer:
    """A Trainer (CPU unless told) for ``epochs`` of ``iterations`` PPO iterations each: no logger,
    bar or summary; checkpoints only when checkpoint callbacks are given."""
    return pl.Trainer(
        plugins=list(plugins),
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_epochs=epochs,
        limit_train_batches=iterations,
        logger=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


def fit_warnings(module: PPOLightningModule, data, iterations: int) -> list[str]:
    """Fit ``module`` on ``data`` for ``iterations`` quiet iterations; the warnings it raised, as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer("unused", iterations=iterations).fit(module, datamodule=data)
    return [str(w.message) for w in caught]


class _FaultyCheckpointIO(AtomicCheckpointIO):
    """The real atomic saver, except that its ``fault_at``-th save of a file named ``name`` (counted
    from 1) writes half of the checkpoint's bytes and then calls :meth:`fault`."""

    def __init__(self, name: str = "last.ckpt", fault_at: int = 2) -> None:
        super().__init__()
        self.name, self.fault_at, self.saves = name, fault_at, 0

    def write(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        if not Path(file.name).name.startswith(f".{self.name}.tmp-"):
            return super().write(checkpoint, file)
        self.saves += 1
        if self.saves != self.fault_at:
            return super().write(checkpoint, file)
        data = io.BytesIO()
        torch.save(checkpoint, data)
        half = len(data.getvalue()) // 2
        file.write(data.getvalue()[:half])
        file.flush()
        self.fault()
        file.write(data.getvalue()[half:])

    def fault(self) -> None:
        raise NotImplementedError


class StallingCheckpointIO(_FaultyCheckpointIO):
    """Stalls ``seconds`` half-way through one save, so that a test can kill the process mid-write."""

    def __init__(self, name: str = "last.ckpt", fault_at: int = 2, seconds: float = 60.0) -> None:
        super().__init__(name, fault_at)
        self.seconds = seconds

    def fault(self) -> None:
        time.sleep(self.seconds)


class DiskFullCheckpointIO(_FaultyCheckpointIO):
    """Runs out of disk space half-way through one save, as ``write(2)`` does: ENOSPC."""

    def fault(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FaultyShardedStrategy(AtomicModelParallelStrategy):
    """FSDP2's atomic sharded saver on ``data_parallel_size`` ranks, except that in its ``fault_at``-th
    save of a folder named ``name`` (counted from 1) rank ``rank``'s shard writer writes half a shard
    file and then stalls ``seconds`` (``fault: stall``) or runs out of disk space (``fault: ENOSPC``)."""

    def __init__(
        self,
        data_parallel_size: int = 2,
        fault: str = "stall",
        name: str = "last.ckpt",
        fault_at: int = 2,
        rank: int = 0,
        seconds: float = 60.0,
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1)
        self.fault, self.name, self.fault_at, self.rank, self.seconds = fault, name, fault_at, rank, seconds
        self.saves = 0

    def shard_writer(self, folder: Path) -> FileSystemWriter:
        if not folder.name.startswith(f".{self.name}.tmpdir-"):
            return super().shard_writer(folder)
        self.saves += 1
        if self.saves != self.fault_at or self.global_rank != self.rank:
            return super().shard_writer(folder)
        return _HalfShardWriter(folder, self._fault)

    def _fault(self) -> None:
        if self.fault == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        time.sleep(self.seconds)


class _HalfShardWriter(FileSystemWriter):
    def __init__(self, folder: Path, fault) -> None:
        super().__init__(folder)
        self.fault = fault

    def write_data(self, plan, planner):
        with open(Path(self.path) / f"{plan.storage_data.prefix}0.distcp", "wb") as file:
            file.write(b"half a shard")
            file.flush()
            self.fault()
        return super().write_data(plan, planner)


class FillDisk(Callback):
    """After iteration ``at``, fills the filesystem of ``folder`` up to its last ``keep_bytes``
    (before the checkpoint callbacks, which Lightning runs last, save that iteration)."""

    def __init__(self, folder: str, at: int = 2, keep_bytes: int = 64 * 1024) -> None:
        self.folder, self.at, self.keep_bytes = Path(folder), at, keep_bytes

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration != self.at or trainer.global_rank != 0:  # one filler for all ranks
            return
        stats = os.statvfs(self.folder)
        free = stats.f_bavail * stats.f_frsize
        with open(self.folder / "filler", "wb") as file:
            os.posix_fallocate(file.fileno(), 0, free - self.keep_bytes)


def cli_usage_error(capsys, args: list[str]) -> str:
    """Run the CLI in-process with ``args``; it must exit with status 2 and print one error line,
    which is returned without its ``lightning-ppo: error: `` prefix."""
    from lightning_ppo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("lightning-ppo: error: "), errors
    return errors[0].removeprefix("lightning-ppo: error: ")


QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def saver(**init_args) -> dict:
    """A ``PPOCheckpoint`` callback spec for ``--trainer.callbacks``."""
    return {"class_path": "lightning_ppo.checkpoint.PPOCheckpoint", "init_args": init_args}


def quickstart_fit_args(
    policy, root, callbacks: list[dict], *extra: str, prompts: int = 400, config: Path = QUICKSTART
) -> list[str]:
    """``fit`` on the quickstart config (or ``config``), small and quiet: batch 8 of ``prompts`` digit
    prompts, no logger, bar or validation, the given callbacks, everything under ``root``; ``extra``
    last."""
    return [
        *("fit", "--config", str(config), "--model.init_args.policy", str(policy)),
        *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.default_root_dir", str(root), "--trainer.callbacks", json.dumps(callbacks)),
        *("--trainer.val_check_interval", "null", "--trainer.limit_val_batches", "0"),
        *("--data.init_args.batch_size", "8", "--data.init_args.num_prompts", str(prompts)),
        *extra,
    ]


def cli_process(args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """``python -m lightning_ppo.cli ARGS`` in a process of its own, run to its end (see
    :func:`start_cli`). Output captured as text."""
    process = start_cli(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def start_cli(
    args: list[str], entry: str = "lightning_ppo.cli", env: dict[str, str] | None = None, **popen: Any
) -> subprocess.Popen:
    """``python -m ENTRY ARGS`` started in a process of its own, from the repository root with this
    checkout first on the path (Lightning's launcher re-runs that command for every rank); W&B
    disabled unless ``env`` says otherwise. ``popen``: the rest of ``subprocess.Popen``'s arguments."""
    root = Path(__file__).resolve().parents[1]
    if _several_processes(args) and os.environ.get("LIGHTNING_PPO_TEST_RANKS") == "0":
        pytest.fail("this test starts several ranks: mark it @pytest.mark.ranks (tests/conftest.py)")
    full_env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(root), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", entry, *args], cwd=root, env=full_env, **popen)


def communicate(process: Any, timeout: float | None) -> tuple[Any, Any]:
    """``process.communicate(timeout)``; on a timeout the process is killed and reaped, then it raises."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=60)
        raise


def forked_cli_process(args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """:func:`cli_process` in a process forked from an interpreter that has done the imports (see
    :func:`start_forked`): the same command, output and exit status, without the interpreter's start."""
    process = start_forked(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = communicate(process, timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def start_forked(
    args: list[str],
    entry: str = "lightning_ppo.cli",
    env: dict[str, str] | None = None,
    slot: int = 0,
    **popen: Any,
) -> ForkedProcess | subprocess.Popen:
    """:func:`start_cli`'s ``python -m ENTRY ARGS``, forked from a process that has imported what
    ``lightning_ppo.cli`` imports (``tests/zygote.py``, one per ``slot`` and environment, started on
    first use): a process of its own (pid, stdio, environment, exit status, signals), ``ENTRY`` run
    afresh as ``__main__``, only the imports shared; ~5 s of one core less than a new interpreter.
    Not for a test whose subject is the interpreter's start (the console script, what importing
    does) or Lightning's launcher (it re-runs the command per rank: use :func:`start_cli`).

    ``slot``: which zygote; the ranks of one run fork from different ones, so that each has its
    own string hashes (``PYTHONHASHSEED``) as ranks started apart do. ``popen``: ``stdin``,
    ``stdout``, ``stderr`` (``None``, ``PIPE``, ``DEVNULL``, ``STDOUT``, an open file; ``None`` for
    stdin is /dev/null), ``text``, ``start_new_session``; ``interruptible``: Ctrl-C (SIGINT) raises
    KeyboardInterrupt as in an interpreter started with SIGINT's default action, even where this runs
    with SIGINT ignored (a background job), as ``preexec_fn`` resetting SIGINT gives ``Popen``.
    Off Linux, or with ``LIGHTNING_PPO_TEST_NO_FORK=1``, a new interpreter (:func:`start_cli`)."""
    if _several_processes(args) and os.environ.get("LIGHTNING_PPO_TEST_RANKS") == "0":
        pytest.fail("this test starts several ranks: mark it @pytest.mark.ranks (tests/conftest.py)")
    unknown = set(popen) - {"stdin", "stdout", "stderr", "text", "start_new_session", "interruptible"}
    assert not unknown, f"start_forked: {sorted(unknown)} are not supported; use start_cli"
    if os.environ.get(NO_FORK_ENV, "0") != "0" or sys.platform != "linux":  # a new interpreter each
        if popen.pop("interruptible", False):
            popen["preexec_fn"] = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
        return start_cli(args, entry=entry, env=env, **{"stdin": subprocess.DEVNULL, **popen})
    full_env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(_ROOT), **(env or {})}
    return _zygote(slot, full_env).start(entry, list(args), full_env, **popen)


# LIGHTNING_PPO_TEST_NO_FORK=1: start_forked starts a new interpreter (start_cli) every time, as it
# does off Linux (no SOCK_SEQPACKET on macOS): to rule the zygote out when a test behaves oddly.
NO_FORK_ENV = "LIGHTNING_PPO_TEST_NO_FORK"


def forked_run(
    command: list[str],
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` where a ``[sys.executable, "-m", MODULE, *ARGS]`` command run from the
    repository root is forked from the zygote (:func:`start_forked`) rather than started anew; any
    other command runs as ``subprocess.run`` runs it. For code under test that starts its own
    Python processes (the benchmark's runs), where the subject is not the interpreter's start."""
    here = cwd is None or Path(cwd).resolve() == _ROOT
    if kwargs or not here or list(command[:2]) != [sys.executable, "-m"] or len(command) < 3:
        return subprocess.run(
            command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, timeout=timeout, check=check, **kwargs
        )
    process = start_forked(list(command[3:]), entry=command[2], env=env, stdout=stdout, stderr=stderr)
    out, err = communicate(process, timeout)
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, out, err)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


_ROOT = Path(__file__).resolve().parents[1]
_ZYGOTES: dict[tuple[int, frozenset], _Zygote] = {}
_RETIRED: list[_Zygote] = []


def _zygote(slot: int, env: dict[str, str]) -> _Zygote:
    """The zygote of ``slot`` whose environment is ``env`` but for variables read at run time; at
    most two of a slot at a time (~0.5 GB each), the one used least recently retired for a third."""
    from tests.zygote import read_at_run_time

    key = (slot, frozenset((k, v) for k, v in env.items() if not read_at_run_time(k)))
    code = _package_code()
    zygote = _ZYGOTES.get(key)
    if zygote is not None and (zygote.code != code or zygote.process.poll() is not None):
        del _ZYGOTES[key]  # it imported another version of the package, or it is gone
        zygote.retire()
        zygote = None
    if zygote is None:
        same_slot = [k for k in _ZYGOTES if k[0] == slot]  # oldest use first: dicts keep order
        for old in same_slot[: max(len(same_slot) - 1, 0)]:
            _ZYGOTES.pop(old).retire()
        zygote = _ZYGOTES[key] = _Zygote(env, code)
    _ZYGOTES[key] = _ZYGOTES.pop(key)  # the most recently used last
    return zygote


def _package_code() -> tuple[int, int]:
    """(files, newest modification) of lightning_ppo's modules: a zygote whose imports are older
    than an edit is replaced, as a new interpreter would import the edited code (~1 ms)."""
    times = [path.stat().st_mtime_ns for path in (_ROOT / "lightning_ppo").rglob("*.py")]
    return len(times), max(times, default=0)


class _Zygote:
    """The client end of one ``tests/zygote.py`` process (it ends, killing the processes it forked
    that still run, when this process closes its end, at the latest when this process exits)."""

    def __init__(self, env: dict[str, str], code: tuple[int, int]) -> None:
        self.code = code
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = os.path.join(tempfile.gettempdir(), f"lightning-ppo-zygote-{os.getpid()}-{id(self)}.log")
        with open(path, "ab") as log, theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote", str(theirs.fileno()), path],
                pass_fds=[theirs.fileno()],
                cwd=_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.control, self.lock = ours, threading.Lock()

    def retire(self) -> None:
        """Fork no more: the zygote ends once the processes it forked have ended (a client that goes
        away instead has them killed)."""
        if self.process.poll() is None:
            with self.lock, contextlib.suppress(OSError):
                self.control.send(json.dumps({"retire": True}).encode())
            _RETIRED.append(self)  # its end of the socket stays open until then
        _RETIRED[:] = [zygote for zygote in _RETIRED if zygote.process.poll() is None]

    def start(
        self,
        entry: str,
        argv: list[str],
        env: dict[str, str],
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        start_new_session: bool = False,
        interruptible: bool = False,
    ) -> ForkedProcess:
        opened: list[IO] = []

        def fd_of(spec: Any, inherit: int, capture: bool) -> int:
            if spec is None:
                if inherit < 0:
                    opened.append(open(os.devnull, "rb"))
                    return opened[-1].fileno()
                return inherit
            if spec == subprocess.DEVNULL:
                opened.append(open(os.devnull, "r+b"))
                return opened[-1].fileno()
            if spec == subprocess.PIPE:
                assert capture, "start_forked: stdin=PIPE is not supported"
                opened.append(tempfile.TemporaryFile())
                return opened[-1].fileno()
            return spec if isinstance(spec, int) else spec.fileno()

        out = fd_of(stdout, 1, capture=True)
        err = out if stderr == subprocess.STDOUT else fd_of(stderr, 2, capture=True)
        fds = [fd_of(stdin, -1, capture=False), out, err]
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {
            "entry": entry,
            "argv": argv,
            "env": env,
            "cwd": str(_ROOT),
            "session": start_new_session,
            "interruptible": interruptible,
        }
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps(request).encode()], [*fds, theirs.fileno()])
        finally:
            theirs.close()
        captured = {
            name: file
            for name, spec, file in (("stdout", stdout, out), ("stderr", stderr, err))
            if spec == subprocess.PIPE
        }
        captures = {name: next(f for f in opened if f.fileno() == fd) for name, fd in captured.items()}
        for file in opened:
            if file not in captures.values():
                file.close()
        return ForkedProcess([sys.executable, "-m", entry, *argv], status, captures, text)


class ForkedProcess:
    """A process :func:`start_forked` started, as a ``subprocess.Popen`` is used: ``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``communicate`` (what ``PIPE`` captured, once it has ended),
    ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, args: list[str], status: socket.socket, captures: dict[str, IO], text: bool) -> None:
        self.args, self._status, self._captures, self._text = args, status, captures, text
        self._buffer, self.returncode = b"", None
        self.pid = self._message(timeout=None)["pid"]  # the zygote may still be importing

    def _message(self, timeout: float | None) -> dict | None:
        """The next line from the zygote, or None if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            self._status.settimeout(left)
            try:
                chunk = self._status.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError("the zygote went away: see lightning-ppo-zygote-*.log in the temp folder")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._message(timeout=0)
            if message is not None:
                self.returncode = message["returncode"]
                self._status.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["returncode"]
            self._status.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        outputs = []
        for name in ("stdout", "stderr"):
            file = self._captures.get(name)
            if file is None:
                outputs.append(None)
                continue
            file.seek(0)
            data = file.read()
            file.close()
            outputs.append(data.decode(errors="replace") if self._text else data)
        self._captures = {}
        return outputs[0], outputs[1]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process and its group: what it started (Lightning's other ranks, a server)
        would otherwise outlive a test that timed out."""
        from tests.zygote import kill_group

        if self.poll() is None:
            kill_group(self.pid)


def ranks_process(
    args: list[str], timeout: int = 300, ranks: int | None = None, **env: str
) -> subprocess.CompletedProcess:
    """:func:`cli_process` for a multi-rank command line, with every rank started at once (see
    :func:`start_ranks`), run to the end of all of them. Output captured as text, the ranks' together
    as Lightning's launcher leaves it (rank 1 writes to rank 0's stdout and stderr); the exit status
    is rank 0's, or the first other rank's that failed."""
    started = start_ranks(args, ranks=ranks, env=env, capture=True)
    try:
        started.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        started.kill()
        started.wait(timeout=60)
        raise
    stdout, stderr = started.output()
    return subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)


def start_ranks(
    args: list[str],
    ranks: int | None = None,
    env: dict[str, str] | None = None,
    capture: bool = False,
    **popen: Any,
) -> StartedRanks:
    """Every rank of ``python -m lightning_ppo.cli ARGS`` (``ranks`` processes, by default the
    ``--trainer.devices`` of ``args``) started at once, as torchrun or a cluster's scheduler would:
    each told its rank by the variables Lightning's environment reads (``LOCAL_RANK``, ``NODE_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning starts no process itself; each
    forked from a zygote that has done the imports (:func:`start_forked`, one zygote per rank).

    For a test whose subject is not Lightning's launcher: that launcher starts rank 1 only once rank 0
    has imported torch, Lightning and transformers and reached ``fit`` (~5 s of one core, one rank
    after the other, and as much again for rank 1's imports). Lightning's launcher also stops every
    rank within 5 s of one failing; so does this. ``capture``: both ranks' stdout and stderr into one
    file each, read with :meth:`StartedRanks.output`. ``popen``: :func:`start_forked`'s, for every
    rank."""
    if ranks is None:
        values = [value for flag, value in zip(args, args[1:], strict=False) if flag == "--trainer.devices"]
        assert values, "start_ranks: no --trainer.devices in the command line; say how many ranks"
        ranks = int(values[-1])
    together = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_RANK": "0",
        "WORLD_SIZE": str(ranks),
    }
    return _together(
        lambda rank, **streams: start_forked(
            args, env={**(env or {}), **together, "LOCAL_RANK": str(rank)}, slot=rank, **streams
        ),
        ranks,
        capture,
        popen,
    )


def spawn_forked(function: Any, args: tuple = (), nprocs: int = 2, timeout: float = 300) -> None:
    """``torch.multiprocessing.spawn(function, args, nprocs)``: ``function(rank, *args)`` in
    ``nprocs`` processes at once, each forked from a zygote that has done the imports (``args`` must
    be JSON values; ``function`` a module-level function). Raises if a process fails (the others are
    stopped), with its output."""
    module, name, values = function.__module__, function.__qualname__, json.dumps(list(args))
    started = _together(
        lambda rank, **streams: start_forked(
            [module, name, str(rank), values], entry="tests.call", slot=rank, **streams
        ),
        nprocs,
        True,
        {},
    )
    try:
        started.wait(timeout=timeout)
    finally:
        if started.returncode is None:
            started.kill()
            started.wait(timeout=60)
    stdout, stderr = started.output()
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    codes = [process.returncode for process in started.processes]
    assert codes == [0] * nprocs, f"{module}.{name}: exit statuses {codes}\n{stderr[-5000:]}"


def _together(start: Any, count: int, capture: bool, popen: dict[str, Any]) -> StartedRanks:
    """``start(rank, **popen)`` for every rank, the processes watched as one."""
    outputs = None
    if capture:  # one file for all: a shared offset, as the ranks of Lightning's launcher share rank 0's
        outputs = tuple(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") for _ in "12")
        popen = {**popen, "stdout": outputs[0], "stderr": outputs[1]}
    processes = []
    try:
        for rank in range(count):
            processes.append(start(rank, **popen))
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return StartedRanks(processes, outputs)


class StartedRanks:
    """The processes of :func:`start_ranks`, polled, waited for and killed as one (``pid``: rank 0's).
    A watcher does what Lightning's launcher does in rank 0: once a rank has failed, the others are
    given 5 s to end (to print their own error) and then killed, so none waits in a collective for a
    rank that is gone."""

    GRACE_S = 5.0

    def __init__(self, processes: list[ForkedProcess], outputs: tuple[IO[str], IO[str]] | None) -> None:
        self.processes, self._outputs = processes, outputs
        self.args, self.pid = processes[0].args, processes[0].pid
        self._ended = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="ranks-watcher")
        self._watcher.start()

    def _watch(self) -> None:
        """The only reader of the processes' states (a ForkedProcess is polled from one thread)."""
        failed_at = None
        while True:
            codes = [process.poll() for process in self.processes]
            if None not in codes:
                self._ended.set()
                return
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.GRACE_S:
                for process in self.processes:
                    if process.returncode is None:
                        process.kill()
            time.sleep(0.05)

    @property
    def returncode(self) -> int | None:
        """Rank 0's exit status, or the first other rank's that failed; None while one still runs."""
        if not self._ended.is_set():
            return None
        return next((p.returncode for p in self.processes if p.returncode != 0), 0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        for process in self.processes:
            if process.returncode is None:  # read, not polled: the watcher alone polls
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def kill(self) -> None:
        from tests.zygote import kill_group

        for process in self.processes:
            if process.returncode is None:  # read, not polled (as in send_signal)
                kill_group(process.pid)

    def output(self) -> tuple[str, str]:
        """Both ranks' stdout and stderr (``capture=True``), once they have ended."""
        assert self._outputs is not None and self.returncode is not None
        texts = []
        for file in self._outputs:
            file.seek(0)
            texts.append(file.read())
            file.close()
        return texts[0], texts[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _several_processes(args: list[str]) -> bool:
    """Whether a command line runs more than one rank (devices, nodes or torchrun processes)."""
    counts = {"--trainer.devices", "--trainer.num_nodes", "--nproc-per-node", "--nnodes"}
    return any(
        flag in counts and value not in ("1", "auto") for flag, value in zip(args, args[1:], strict=False)
    )


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The error a ``cli_process`` run ended with: exit status 2, no traceback, and the error one line,
    the last (Lightning's start-up lines may come before an error raised in training). Returned
    without its ``lightning-ppo: error: `` prefix."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("lightning-ppo: error: ")]
    assert errors == [len(lines) - 1], done.stderr[-3000:]
    return lines[-1].removeprefix("lightning-ppo: error: ")


def two_cpu_ranks(strategy: str | dict, iterations: int = 2) -> tuple[str, ...]:
    """Command-line options for ``iterations`` iterations on 2 CPU processes under ``strategy``
    (a registered name or a class_path spec), without checkpoints."""
    spec = strategy if isinstance(strategy, str) else json.dumps(strategy)
    return (
        *("--trainer.strategy", spec, "--trainer.devices", "2", "--trainer.accelerator", "cpu"),
        *("--trainer.limit_train_batches", str(iterations), "--trainer.enable_checkpointing", "false"),
    )


class FailsInTheSecondIteration(Environment):
    """RevealDigits-like, but its step raises once the second batch of 8 episodes has started
    (episodes are counted across the copies, in the class)."""

    started = 0

    def reset(self, prompt, row, rng) -> None:
        FailsInTheSecondIteration.started += 1

    def step(self, turn):
        if FailsInTheSecondIteration.started > 8:
            raise ConnectionError("the sandbox went away")
        return StepResult(observation="1=") if turn.index == 0 else StepResult(reward=1.0, done=True)


class TrainedPromptLog(pl.Callback):
    """Appends ``ITERATION<TAB>PROMPT`` for every prompt trained, as each iteration ends (flushed and
    synced: a SIGKILL right after loses nothing written); rank r > 0 to ``PATH.r``. First in the
    callback list, so a checkpoint saved at the same batch end comes after the line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen = -1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if module.iteration == self.seen or module.last_samples is None:
            return
        self.seen = module.iteration
        path = self.path + (f".{trainer.global_rank}" if trainer.global_rank else "")
        with open(path, "a") as file:
            file.writelines(f"{module.iteration}\t{prompt}\n" for prompt in module.last_samples.prompts)
            file.flush()
            os.fsync(file.fileno())


def quickstart_csv_args(policy: Path | str, root: Path, overrides: dict[str, str]) -> list[str]:
    """``fit`` arguments of configs/quickstart.yaml on ``policy`` under ``root``: the CSV logger, no
    validation, bar, checkpoints or callbacks, then ``overrides``. On CPU a vLLM engine's KV budget
    is this share of the node's memory minus what the process already holds (~1 GiB with Lightning
    and the model loaded): 0.05 of 19 GiB left nothing, hence 0.15."""
    args = {
        "--config": str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"),
        "--model.init_args.policy": str(policy),
        "--model.init_args.generation.gpu_memory_utilization": "0.15",
        "--trainer.limit_val_batches": "0",
        "--trainer.default_root_dir": str(root),
        "--trainer.logger": '{"class_path": "lightning_ppo.loggers.CSVLogger"}',
        "--trainer.enable_progress_bar": "false",
        "--trainer.enable_checkpointing": "false",
        "--trainer.callbacks": "[]",
        **overrides,
    }
    return ["fit", *(part for pair in args.items() for part in pair)]


def lora_that_matters(policy_dir: Path | str, seed: int = 2) -> Any:
    """The checkpoint at ``policy_dir`` with a rank-4 LoRA adapter whose B factors are random (PEFT
    starts them at 0, which would leave the adapter without effect)."""
    from lightning_ppo.models.loading import load_causal_lm
    from lightning_ppo.models.roles import LoraSettings, apply_lora

    policy = apply_lora(load_causal_lm(str(policy_dir)), LoraSettings(r=4))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn_like(param))
    return policy
