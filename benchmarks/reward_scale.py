"""Reward scale against the KL penalty: the quickstart task with its reward shrunk 30-fold.

    .venv/bin/python -m benchmarks.reward_scale                 # 250 iterations per variant
    .venv/bin/python -m benchmarks.reward_scale --iterations 40 # a smoke run

The digits reward spreads over [0, 1]; multiplied by 0.03 (``reward_weights: [0.03]``) it spreads
like a sentence-similarity score does, comparable to a few nats of KL x ``kl_coef``. Each variant
runs ``lightning-ppo fit`` on ``configs/quickstart.yaml`` (or ``configs/grpo.yaml``) in its own
process and reads its CSV log: the reward's own score (``objective/scores`` divided by the weight,
so every row is on the task's 0-1 scale) over the first and last 10 % of iterations, the KL per
response and the KL coefficient at the end, and whether the reward-scale warning fired.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import quiet_fit_command
from benchmarks.flags import at_least_one

ROOT = Path(__file__).resolve().parents[1]
WEIGHT = 0.03


@dataclass(frozen=True)
class Variant:
    name: str
    config: str
    weight: float
    overrides: tuple[str, ...] = ()


VARIANTS = (
    Variant("reward x1, kl_coef 0.05 (the quickstart)", "quickstart.yaml", 1.0),
    Variant("reward x0.03, kl_coef 0.05", "quickstart.yaml", WEIGHT),
    Variant(
        "reward x0.03, score_norm", "quickstart.yaml", WEIGHT, ("--model.init_args.ppo.score_norm", "true")
    ),
    Variant(
        "reward x0.03, score_norm, kl_target 2",
        "quickstart.yaml",
        WEIGHT,
        ("--model.init_args.ppo.score_norm", "true", "--model.init_args.ppo.kl_target", "2"),
    ),
    Variant("GRPO (k3 KL in the loss), reward x0.03", "grpo.yaml", WEIGHT),
    Variant("GRPO, reward x0.03, kl_target 2", "grpo.yaml", WEIGHT, ("--model.init_args.ppo.kl_target", "2")),
)


def run(variant: Variant, policy: str, iterations: int, horizon: int, out: Path) -> dict[str, float]:
    cmd = quiet_fit_command(variant.config, policy, out, iterations)
    cmd += ["--model.init_args.reward_weights", f"[{variant.weight}]"]
    cmd += ["--model.init_args.ppo.kl_horizon", str(horizon), *variant.overrides]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    (log,) = out.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(log.open()) if r.get("objective/scores")]
    tenth = max(1, len(rows) // 10)

    def mean(key: str, part: list[dict]) -> float:
        return sum(float(r[key]) for r in part) / len(part)

    return {
        "first": mean("objective/scores", rows[:tenth]) / variant.weight,
        "last": mean("objective/scores", rows[-tenth:]) / variant.weight,
        "kl": mean("objective/kl", rows[-tenth:]),
        "kl_coef": float(rows[-1]["kl_coef"]),
        "warned": float("so the score will stay flat" in done.stderr),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=at_least_one, default=250)
    parser.add_argument(
        "--kl-horizon", type=at_least_one, default=1000, help="ppo.kl_horizon of every variant"
    )
    parser.add_argument("--policy", default=str(ROOT / "checkpoints" / "tiny-digits"))
    ns = parser.parse_args()
    print(f"{ns.iterations} iterations per variant, ppo.kl_horizon {ns.kl_horizon}, policy {ns.policy}")
    print(
        "| variant | score, first 10 % | score, last 10 % | KL per response, last 10 % "
        "| kl_coef at the end | warned |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(VARIANTS):
            r = run(variant, ns.policy, ns.iterations, ns.kl_horizon, Path(tmp) / str(i))
            print(
                f"| {variant.name} | {r['first']:.3f} | {r['last']:.3f} | {r['kl']:.2f} | {r['kl_coef']:.4f} "
                f"| {'yes' if r['warned'] else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
