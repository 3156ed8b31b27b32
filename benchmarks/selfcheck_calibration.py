"""How close correct setups get to the selfcheck's exact optimum, and how far injected bugs end up.

    .venv/bin/python -m benchmarks.selfcheck_calibration                  # every variant below
    .venv/bin/python -m benchmarks.selfcheck_calibration --variants gae rloo --seeds 0 1 2

Each variant runs ``lightning_ppo.selfcheck.selfcheck`` in this process with :class:`ExactDistance`
among the Trainer's callbacks: after every iteration it computes the trained policy's exact
``KL(pi || pi*)`` (every response listed) and logs it as ``selfcheck/distance``. Printed per run:
the exact reward and KL, the plateau's, the gaps and bands, the verdict, the mean of that distance
over the plateau (what the verdict's allowance ``eps`` stands for; docs/selfcheck.md), the final
policy's distance and the wall time. Single-process variants only (the callback reads the whole
policy).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

from lightning_ppo.selfcheck import selfcheck
from lightning_ppo.selfcheck.optimum import ListedTask, distance_of_policy, list_task
from lightning_ppo.selfcheck.task import SelfcheckTask
from lightning_ppo.watch.plot import read_metrics

DISTANCE = "selfcheck/distance"
CALLBACK = "benchmarks.selfcheck_calibration.ExactDistance"  # appended to the selfcheck's own
ESTIMATOR = "--model.init_args.ppo.advantage_estimator"
GROUPS = ("--model.init_args.ppo.num_generations", "4")
BUGS = "--model.class_path", "tests.selfcheck_bugs."
VARIANTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "gae": ((), {}),
    "gae shared critic": (("--model.init_args.value_model", "shared"), {}),
    "rloo": ((ESTIMATOR, "rloo", *GROUPS), {"batch_size": 16}),
    "grpo": ((ESTIMATOR, "grpo", *GROUPS), {"batch_size": 16}),
    "lora": (("--model.init_args.lora", "{r: 8, alpha: 16}"), {"lr": 1e-2}),
    "max_staleness 1": (("--model.init_args.ppo.max_staleness", "1"), {}),
    "temperature 0.7": (("--model.init_args.generation.temperature", "0.7"), {}),
    "kl_estimator k3 (in the reward)": (("--model.init_args.ppo.kl_estimator", "k3"), {}),
    "top_k 2": (("--model.init_args.generation.top_k", "2"), {}),
    "bug: KL with the wrong sign": ((BUGS[0], BUGS[1] + "WrongSignKL"), {}),
    "bug: reference is the policy": ((BUGS[0], BUGS[1] + "ReferenceIsPolicy"), {}),
    "bug: log-probs shifted by one": ((BUGS[0], BUGS[1] + "LogprobsShiftedByOne"), {}),
}


class ExactDistance(Callback):
    """Logs the trained policy's exact ``KL(pi || pi*)`` after every iteration (the task listed once)."""

    def __init__(self) -> None:
        self.listed: ListedTask | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.listed is None:
            self.listed = list_task(pl_module, SelfcheckTask(beta=pl_module.ppo.kl_coef))
        distance = distance_of_policy(self.listed, pl_module.policy, pl_module.ppo.kl_coef)
        pl_module.log(DISTANCE, distance, on_step=True, batch_size=1)


def run(name: str, seed: int, root: Path, extra: tuple[str, ...]) -> str:
    args, kwargs = VARIANTS[name]
    out = root / f"{name.replace(' ', '_').replace(':', '')}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    task = SelfcheckTask(seed=seed)
    result = selfcheck(out, *args, *extra, "--trainer.callbacks+", CALLBACK, task=task, draw=False, **kwargs)
    seconds = time.perf_counter() - started
    if result.stopped is not None:
        return f"{name:32s} seed {seed}: stopped ({result.stopped[:60]}...) {seconds:.0f} s"
    _, series = read_metrics(result.metrics)
    distances = series[DISTANCE][1]
    plateau = distances[-result.iterations :]
    checks = "; ".join(
        f"{c.name} {c.exact:.4f} -> {c.reached:.4f} ({c.gap:+.4f} in [{c.low:+.4f}, {c.high:+.4f}])"
        for c in (result.reward, result.kl, result.objective)
    )
    verdict = "PASS" if result.passed else "FAIL"
    mean = sum(plateau) / len(plateau)
    distance = f"distance {mean:.4f}, final {distances[-1]:.4f}"
    return f"{name:32s} seed {seed}: {checks}; {verdict}; {distance}; {seconds:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more fit options")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="selfcheck-calibration-") as root:
        for name in ns.variants:
            for seed in ns.seeds:
                print(run(name, seed, Path(root), tuple(ns.extra)), flush=True)


if __name__ == "__main__":
    main()
