"""The selfcheck on every setup it must pass and every bug it must fail: docs/selfcheck.md's table.

    .venv/bin/python -m benchmarks.selfcheck_calibration                  # every variant below
    .venv/bin/python -m benchmarks.selfcheck_calibration --variants gae rloo --seeds 0 1 2

One process per variant's run, one thread each (``OMP_NUM_THREADS=1``), run one after another. A
single-process variant runs ``lightning_ppo.selfcheck.selfcheck`` in this process with
:class:`ExactDistance` among the Trainer's callbacks: after every iteration it computes the trained
policy's exact ``KL(pi || pi*)`` (every response listed) and logs it as ``selfcheck/distance``, whose
mean over the plateau is what the verdict's allowance ``eps`` stands for. A variant on 2 CPU ranks
runs ``python -m lightning_ppo.cli selfcheck`` through Lightning's launcher and reads its
``selfcheck.json`` (the final policy's distance where its weights are whole on rank 0). Printed: a
Markdown row per run, with the exact reward and KL, what the plateau reached, the gaps and the
objective's band, the verdict, the distances and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

from benchmarks.flags import at_least_one, positive
from lightning_ppo.selfcheck import selfcheck
from lightning_ppo.selfcheck.optimum import ListedEpisodes, ListedTask, list_task
from lightning_ppo.selfcheck.task import SelfcheckTask
from lightning_ppo.watch.plot import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DISTANCE = "selfcheck/distance"
CALLBACK = "benchmarks.selfcheck_calibration.ExactDistance"  # appended to the selfcheck's own
ESTIMATOR = "--model.init_args.ppo.advantage_estimator"
GROUPS = ("--model.init_args.ppo.num_generations", "4")
BUG = "--model.class_path"
K3 = ("--model.init_args.ppo.kl_estimator", "k3")
FSDP2 = json.dumps(
    {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
    }
)
TWO_RANKS = ("--batch-size", "32", "--trainer.devices", "2", "--trainer.strategy")
# name: (selfcheck options, selfcheck() keywords, on 2 ranks)
VARIANTS: dict[str, tuple[tuple[str, ...], dict, bool]] = {
    "gae": ((), {}, False),
    "gae, shared critic": (("--model.init_args.value_model", "shared"), {}, False),
    "rloo": ((ESTIMATOR, "rloo", *GROUPS), {"batch_size": 16}, False),
    "grpo": ((ESTIMATOR, "grpo", *GROUPS), {"batch_size": 16}, False),
    "LoRA": (("--model.init_args.lora", "{r: 8, alpha: 16}"), {"lr": 1e-2}, False),
    "max_staleness 1": (("--model.init_args.ppo.max_staleness", "1"), {}, False),
    "temperature 0.7": (("--model.init_args.generation.temperature", "0.7"), {}, False),
    "DDP, 2 CPU ranks": ((*TWO_RANKS, "ddp"), {}, True),
    "FSDP2, 2 CPU ranks": ((*TWO_RANKS, FSDP2), {}, True),
    "grpo, k3 in the loss (configs/grpo.yaml)": (
        (ESTIMATOR, "grpo", *GROUPS, *("--model.init_args.ppo.kl_placement", "loss"), *K3),
        {"batch_size": 16},
        False,
    ),
    "grpo, k2 in the loss": (
        (ESTIMATOR, "grpo", *GROUPS, "--model.init_args.ppo.kl_placement", "loss", *K3[:1], "k2"),
        {"batch_size": 16},
        False,
    ),
    "kl_estimator k3 (in the reward)": (K3, {}, False),
    "top_k 2": (("--model.init_args.generation.top_k", "2"), {}, False),
    "bug: KL with the wrong sign": ((BUG, "tests.selfcheck_bugs.WrongSignKL"), {}, False),
    "bug: reference is the policy": ((BUG, "tests.selfcheck_bugs.ReferenceIsPolicy"), {}, False),
    "bug: log-probs shifted by one": ((BUG, "tests.selfcheck_bugs.LogprobsShiftedByOne"), {}, False),
    "two turns, gae": ((), {"turns": 2}, False),
    "two turns, rloo": ((ESTIMATOR, "rloo", *GROUPS), {"batch_size": 16, "turns": 2}, False),
    "two turns, bug: KL with the wrong sign": (
        (BUG, "tests.selfcheck_bugs.WrongSignKL"),
        {"turns": 2},
        False,
    ),
    "two turns, bug: reference is the policy": (
        (BUG, "tests.selfcheck_bugs.ReferenceIsPolicy"),
        {"turns": 2},
        False,
    ),
    "two turns, bug: log-probs shifted by one": (
        (BUG, "tests.selfcheck_bugs.LogprobsShiftedByOne"),
        {"turns": 2},
        False,
    ),
}
HEADER = (
    "| setup | seed | E[r]: exact -> reached (gap) | KL: exact -> reached (gap) | objective gap [band] "
    "| verdict | distance: plateau, final | s |\n|---|---|---|---|---|---|---|---|"
)


class ExactDistance(Callback):
    """Logs the trained policy's exact ``KL(pi || pi*)`` after every iteration (the task listed once).

    Args:
        turns: The task's (``SelfcheckTask.turns``).
    """

    def __init__(self, turns: int = 1) -> None:
        self.turns = turns
        self.listed: ListedTask | ListedEpisodes | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.listed is None:
            self.listed = list_task(pl_module, task_of(self.turns))
        distance = self.listed.distance(pl_module.policy, pl_module.ppo.kl_coef)
        pl_module.log(DISTANCE, distance, on_step=True, batch_size=1)


def task_of(turns: int, seed: int = 0) -> SelfcheckTask:
    return SelfcheckTask(seed=seed) if turns == 1 else SelfcheckTask.two_turns(seed=seed)


def in_process(out: Path, seed: int, args: tuple[str, ...], kwargs: dict) -> tuple[dict, str]:
    """The selfcheck in this process: its result, and the mean distance over its plateau."""
    turns = kwargs.pop("turns", 1)
    callback = json.dumps({"class_path": CALLBACK, "init_args": {"turns": turns}})
    task = task_of(turns, seed)
    result = selfcheck(out, *args, f"--trainer.callbacks+={callback}", task=task, draw=False, **kwargs)
    if result.stopped is not None:
        return json.loads(result.to_json()), "n/a"
    distances = read_metrics(result.metrics)[1][DISTANCE][1][-result.iterations :]
    return json.loads(result.to_json()), f"{sum(distances) / len(distances):.4f}"


def on_ranks(out: Path, seed: int, args: tuple[str, ...]) -> tuple[dict, str]:
    """The selfcheck as a command on 2 ranks (Lightning's launcher starts the second)."""
    command = [sys.executable, "-m", "lightning_ppo.cli", "selfcheck", "--out", str(out), "--seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*command, "--no-plot", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if not (out / "selfcheck.json").exists():
        raise RuntimeError(f"the selfcheck exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads((out / "selfcheck.json").read_text()), "n/a"


def row(name: str, seed: int, root: Path, lr: float | None, iterations: int | None = None) -> str:
    args, kwargs, ranks = VARIANTS[name]
    given = {"lr": lr, "iterations": iterations}
    kwargs = {**kwargs, **{k: v for k, v in given.items() if v is not None}}  # a copy: "turns" is taken out
    out = root / f"{name.replace(' ', '_').replace(':', '').replace(',', '')}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    result, plateau = on_ranks(out, seed, args) if ranks else in_process(out, seed, args, kwargs)
    seconds = time.perf_counter() - started
    if result["stopped"] is not None:
        return f"| {name} | {seed} | stopped: {result['stopped'][:60]} | | | FAIL | | {seconds:.0f} |"
    r, k, j = result["reward"], result["kl"], result["objective"]
    final = "n/a" if result["policy_distance"] is None else f"{result['policy_distance']:.4f}"
    return (
        f"| {name} | {seed} | {r['exact']:.4f} -> {r['reached']:.4f} ({r['gap']:+.4f}) "
        f"| {k['exact']:.4f} -> {k['reached']:.4f} ({k['gap']:+.4f}) "
        f"| {j['gap']:+.4f} [{j['low']:+.4f}, {j['high']:+.4f}] | {'PASS' if result['passed'] else 'FAIL'} "
        f"| {plateau}, {final} | {seconds:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--lr", type=positive, default=None, help="the learning rate (default the selfcheck's)"
    )
    parser.add_argument("--iterations", type=at_least_one, default=None, help="(default the selfcheck's)")
    ns = parser.parse_args()
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="selfcheck-calibration-") as root:
        for name in ns.variants:
            for seed in ns.seeds:
                print(row(name, seed, Path(root), ns.lr, ns.iterations), flush=True)


if __name__ == "__main__":
    main()
