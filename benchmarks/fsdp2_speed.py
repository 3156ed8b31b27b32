"""FSDP2 against DDP on 2 CPU ranks: seconds per PPO iteration, and where FSDP2's time goes.

    .venv/bin/python -m benchmarks.fsdp2_speed                  # the quickstart task, 30 iterations
    .venv/bin/python -m benchmarks.fsdp2_speed --gpt2-small     # GPT-2-small-sized models, 6 iterations

Both run the real CLI (``configs/fsdp2.yaml``: tiny-digits, the digits reward, 32 prompts per rank,
8 new tokens, 4 epochs x 2 minibatches), once with ``ddp`` and once per FSDP2 variant, alternating
``--rounds`` times. ``--gpt2-small``: a 12 x 768 GPT-2 (vocab 50257) policy, reference and critic
and a reward model of that size (as ``benchmarks.sharded_memory``), 4 prompts per rank, 1 epoch x
1 minibatch. Each rank runs with ``OMP_NUM_THREADS=1`` (2 ranks on 2 cores).

Reported per setting (the slower rank, medians over the iterations after the first): seconds per
iteration, and its phases: generation, scoring, the rollout forwards (policy, reference, critic),
the PPO update; the process's CPU seconds per iteration (both ranks' work, without the time spent
waiting, for the other rank or for a core: on a shared machine the steadier figure); FSDP2's
all-gathers and reduce-scatters per iteration (one call per FSDP unit); and every collective the
ranks wait on together per iteration: each ``torch.distributed`` call from Python (FSDP2's
included, an ``all_gather_object`` once), not DDP's gradient all-reduces, which its C++ reducer
issues (one per bucket, a bucket per step for the quickstart's models).
Each round runs every setting once, in an order rotated from round to round; "x DDP" is the median
over the rounds of each round's ratio to that round's DDP run (on a machine shared with other jobs
the ratio within a round is what holds, the seconds drift).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.flags import at_least_one
from lightning_ppo.module import PPOLightningModule

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}
PHASES = ("generate", "score", "rollout_forwards", "ppo_update")
COLLECTIVES = (
    *("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor"),
    *("reduce_scatter_single", "broadcast", "barrier", "all_gather_object", "broadcast_object_list"),
)


class TimedPPO(PPOLightningModule):
    """The module, timing its phases and counting FSDP2's collectives; each rank writes them to
    ``$FSDP2_SPEED_OUT/rank<k>.json`` when training ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inside = False
        self.timings: dict[str, list[float]] = {name: [] for name in (*PHASES, "iteration", "cpu")}
        self.collectives = {"all_gather": 0, "reduce_scatter": 0, "collectives": 0}
        for name in PHASES:
            setattr(self, name, self._timed(name, getattr(self, name)))

    def _timed(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.timings[name].append(time.perf_counter() - start)

        return timed

    def on_fit_start(self) -> None:
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

        gather, reduce = param_group.foreach_all_gather, param_group.foreach_reduce
        counts = self.collectives

        def counted_gather(*args: Any, **kwargs: Any) -> Any:
            counts["all_gather"] += 1
            return gather(*args, **kwargs)

        def counted_reduce(*args: Any, **kwargs: Any) -> Any:
            counts["reduce_scatter"] += 1
            return reduce(*args, **kwargs)

        param_group.foreach_all_gather, param_group.foreach_reduce = counted_gather, counted_reduce
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, collective: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # all_gather_object's own all_gathers: counted once, as it
                return collective(*args, **kwargs)
            self._inside, self.collectives["collectives"] = True, self.collectives["collectives"] + 1
            try:
                return collective(*args, **kwargs)
            finally:
                self._inside = False

        return counted

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._start, self._cpu, self._counts = (
            time.perf_counter(),
            time.process_time(),
            dict(self.collectives),
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.timings["iteration"].append(time.perf_counter() - self._start)
        self.timings["cpu"].append(time.process_time() - self._cpu)
        for name, count in self.collectives.items():
            self.timings.setdefault(name, []).append(count - self._counts[name])

    def on_train_end(self) -> None:
        out = Path(os.environ["FSDP2_SPEED_OUT"])
        row = {"timings": self.timings, "collectives": self.collectives, "iterations": self.iteration}
        (out / f"rank{self.global_rank}.json").write_text(json.dumps(row))


def gpt2_small_args(root: Path) -> list[str]:
    from benchmarks.roles_memory import write_checkpoints

    policy, reward = write_checkpoints(root, small=False)
    return [
        *("--model.init_args.policy", str(policy), "--model.init_args.reward_model", str(reward)),
        *("--model.init_args.value", str(policy), "--data.init_args.batch_size", "4"),
        *("--model.init_args.ppo.ppo_epochs", "1", "--model.init_args.ppo.num_minibatches", "1"),
    ]


def run(strategy: str | dict, iterations: int, extra: list[str]) -> dict[str, Any]:
    """One CLI run on 2 ranks; the slower rank's medians (first iteration left out), counts too."""
    with tempfile.TemporaryDirectory() as out:
        args = [
            *("fit", "--config", str(ROOT / "configs" / "fsdp2.yaml")),
            *("--model.class_path", "benchmarks.fsdp2_speed.TimedPPO"),
            *("--trainer.strategy", strategy if isinstance(strategy, str) else json.dumps(strategy)),
            *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
            *("--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"),
            *("--trainer.limit_train_batches", str(iterations), "--trainer.default_root_dir", out),
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        env["FSDP2_SPEED_OUT"] = out
        command = [sys.executable, "-m", "lightning_ppo.cli", *args]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        ranks = [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return {
        name: max(statistics.median(r["timings"][name][1:] or [0.0]) for r in ranks)
        for name in (*PHASES, "iteration", "cpu", "all_gather", "reduce_scatter", "collectives")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt2-small", action="store_true", help="GPT-2-small-sized models")
    parser.add_argument("--iterations", type=at_least_one, default=None, help="PPO iterations per run")
    parser.add_argument("--rounds", type=at_least_one, default=1, help="runs of every setting, alternating")
    parser.add_argument("--no-gather", action="store_true", help="add FSDP2 with gather_for_generation false")
    ns = parser.parse_args()
    iterations = ns.iterations or (6 if ns.gpt2_small else 30)
    settings: dict[str, tuple[str | dict, list[str]]] = {"DDP": ("ddp", []), "FSDP2": (FSDP2, [])}
    if ns.no_gather:
        off = ["--model.init_args.generation.gather_for_generation", "false"]
        settings["FSDP2, gather_for_generation false"] = (FSDP2, off)
    rows: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        extra = gpt2_small_args(Path(tmp)) if ns.gpt2_small else []
        names = list(settings)
        for round_ in range(ns.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                strategy, more = settings[name]
                rows[name].append(run(strategy, iterations, extra + more))
    model = "GPT-2-small-sized" if ns.gpt2_small else "quickstart"
    print(f"{model}, 2 CPU ranks (OMP_NUM_THREADS=1 each), {iterations} iterations, {ns.rounds} round(s)")
    print("| setting | s / iteration | x DDP | CPU s / iteration | x DDP | generate s | score s "
          "| rollout forwards s | PPO update s | all-gathers / iteration | reduce-scatters / iteration "
          "| collectives / iteration |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in rows.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        ratios = [
            [r[key] / d[key] for r, d in zip(runs, rows["DDP"], strict=True)] for key in ("iteration", "cpu")
        ]
        wall, cpu = (f"{statistics.median(x):.2f} ({', '.join(f'{y:.2f}' for y in x)})" for x in ratios)
        print(
            f"| {name} | {med['iteration']:.3f} | {wall} | {med['cpu']:.3f} | {cpu} | {med['generate']:.3f} "
            f"| {med['score']:.3f} | {med['rollout_forwards']:.3f} | {med['ppo_update']:.3f} "
            f"| {med['all_gather']:.0f} | {med['reduce_scatter']:.0f} | {med['collectives']:.0f} |"
        )


if __name__ == "__main__":
    main()
