"""Issue 23's table on a task built here: learning on a small-spread reward, random and warm-started.

    .venv/bin/python -m benchmarks.learning                   # 300 iterations per variant
    .venv/bin/python -m benchmarks.learning --iterations 40   # a smoke run

The user's task was a sentence-similarity reward whose scores spread by ~0.03, a small GPT-2,
random and after a short supervised warm-up. Here: the quickstart's digits reward multiplied by
0.03 (``reward_weights: [0.03]``; scores below are divided by 0.03 again, so every row is on the
task's 0-1 scale), the quickstart's tiny GPT-2, random and warm-started by :func:`warm_start`
(teacher-forced on "47192=" -> "47192<eos>" until it scores about 0.5). Each variant runs
``lightning-ppo fit`` in its own process and reads its CSV log. Columns: the score over the first
10 % of iterations, over the best 10 % window and over the last 10 %; the KL per response over the
last 10 % and its maximum (of the 10-iteration mean); with a ``kl_target``, the share of iterations
after the first 10 % whose 10-iteration mean KL lies within +-50 % of the target; approxkl at the
first iteration; and the guardrails that spoke.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import quiet_fit_command
from benchmarks.flags import at_least, at_least_one

ROOT = Path(__file__).resolve().parents[1]
WEIGHT = 0.03
SMOOTHING = 10
RECIPE = ("--model.init_args.ppo.score_norm", "true", "--model.init_args.ppo.kl_target", "4")
GUARDRAIL_MARKS = {
    "trust region": "far outside PPO's clip range",
    "collapse": "response collapse",
    "kl_coef bound": "the policy moves faster than the penalty",
    "reward drowned": "so the score will stay flat",
    "converging answers": "answers are converging",
    "steps too small": "the policy has barely moved from the reference",
}


@dataclass(frozen=True)
class Variant:
    name: str
    config: str
    warm: bool = False
    overrides: tuple[str, ...] = ()
    kl_target: float | None = None


VARIANTS = (
    Variant("defaults (kl_coef 0.05, the module's default lr)", "quickstart.yaml", overrides=("--lr",)),
    Variant("README recipe: score_norm, kl_target 4", "quickstart.yaml", overrides=RECIPE, kl_target=4),
    Variant(
        "GRPO, k3 in the loss, kl_target 4",
        "grpo.yaml",
        overrides=("--model.init_args.ppo.kl_target", "4"),
        kl_target=4,
    ),
    Variant(
        "warm-started, README recipe, default lr", "quickstart.yaml", True, (*RECIPE, "--lr"), kl_target=4
    ),
    Variant(
        "warm-started, lr 1e-4, kl_target 8",
        "quickstart.yaml",
        True,
        ("--model.init_args.ppo.score_norm", "true", "--model.init_args.ppo.kl_target", "8", "--lr=0.0001"),
        kl_target=8,
    ),
    Variant(
        "warm-started, README recipe, lr 1e-3 (the old default)",
        "quickstart.yaml",
        True,
        (*RECIPE, "--lr=0.001"),
        kl_target=4,
    ),
)


def warm_start(policy: str, out: Path, steps: int, seed: int = 0) -> Path:
    """The policy teacher-forced for ``steps`` AdamW steps on copying the prompt's digits, saved in ``out``.

    Tiny and random, it learns the format fast: 30 steps take it from ~0.2 to ~0.47.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_ppo.tasks.digits import digit_prompts

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = digit_prompts(steps * 32, 5, seed + 7)
    texts = [p + t + tokenizer.eos_token for p, t in zip(data["prompt"], data["target"], strict=True)]
    for step in range(steps):
        batch = tokenizer(texts[step * 32 : (step + 1) * 32], return_tensors="pt", add_special_tokens=False)
        labels = batch["input_ids"].clone()
        labels[:, :6] = -100  # the prompt "47192=" is given, not learned
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fit(
    variant: Variant, policy: str, iterations: int, horizon: int | None, out: Path
) -> tuple[list[dict], str]:
    """Run one variant; its CSV rows with scores, and its stderr (where warnings go)."""
    cmd = quiet_fit_command(variant.config, policy, out, iterations)
    cmd += ["--model.init_args.reward_weights", f"[{WEIGHT}]"]
    if horizon is not None:
        cmd += ["--model.init_args.ppo.kl_horizon", str(horizon)]
    for option in variant.overrides:
        if option == "--lr":  # the module's own default optimizer, whatever it is in this tree
            cmd += ["--model.init_args.optimizer", "null"] if _default_optimizer_is_none() else []
        elif option.startswith("--lr="):
            cmd += ["--model.init_args.optimizer.init_args.lr", option.split("=", 1)[1]]
        else:
            cmd.append(option)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant.name} failed:\n{done.stderr[-3000:]}")
    (log,) = out.rglob("metrics.csv")
    return [r for r in csv.DictReader(log.open()) if r.get("objective/scores")], done.stderr


def _default_optimizer_is_none() -> bool:
    """Whether ``optimizer: null`` selects the module's default (older trees: torch's AdamW class,
    which the configs' ``lr: 0.001`` equals)."""
    import inspect

    from lightning_ppo import PPOLightningModule

    return inspect.signature(PPOLightningModule).parameters["optimizer"].default is None


def trailing(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def row(variant: Variant, rows: list[dict], stderr: str) -> str:
    scores = [float(r["objective/scores"]) / WEIGHT for r in rows]
    kl = [float(r["objective/kl"]) for r in rows]
    tenth = max(1, len(rows) // 10)
    windows = trailing(scores, tenth)[tenth - 1 :]
    smooth_kl = trailing(kl, SMOOTHING)
    within = "-"
    if variant.kl_target is not None:
        low, high = 0.5 * variant.kl_target, 1.5 * variant.kl_target
        after = smooth_kl[tenth:]
        within = f"{sum(low <= k <= high for k in after) / len(after):.0%}"
    spoke = [name for name, mark in GUARDRAIL_MARKS.items() if mark in stderr] or ["none"]
    coef = float(rows[-1]["kl_coef"])
    return (
        f"| {variant.name} | {windows[0]:.3f} | {max(windows):.3f} | {windows[-1]:.3f} "
        f"| {sum(kl[-tenth:]) / tenth:.1f} / {max(smooth_kl):.1f} | {within} | {coef:.3g} "
        f"| {float(rows[0]['policy/approxkl_avg']):.3f} | {', '.join(spoke)} |"
    )


def lr_sweep(tmp: Path, warm_steps: int, iterations: int = 3) -> None:
    """The step size of the first iterations against the learning rate, on warm-started policies of
    two widths: the largest policy/approxkl_avg and policy/clipfrac_avg of the first ``iterations``."""
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    print(f"\nlearning rate against the first {iterations} iterations' step (README recipe, warm-started)")
    print("| policy | lr | approxkl, max | clipfrac, max | trust-region guardrail |")
    print("| --- | --- | --- | --- | --- |")
    for spec in (TinyModelSpec(n_layer=2, n_embd=64), TinyModelSpec(n_layer=4, n_embd=256, n_head=4)):
        base = make_tiny_checkpoint(tmp / f"base{spec.n_embd}", spec, alphabet="0123456789=")
        warm = str(warm_start(str(base), tmp / f"warm{spec.n_embd}", warm_steps))
        for lr in ("0.001", "0.0001", "0.00001"):
            variant = Variant("sweep", "quickstart.yaml", True, (*RECIPE, f"--lr={lr}"), kl_target=4)
            rows, stderr = fit(variant, warm, iterations, None, tmp / f"sweep{spec.n_embd}-{lr}")
            approx = max(float(r["policy/approxkl_avg"]) for r in rows)
            clip = max(float(r["policy/clipfrac_avg"]) for r in rows)
            fired = "yes" if GUARDRAIL_MARKS["trust region"] in stderr else "no"
            print(
                f"| {spec.n_layer} x {spec.n_embd} | {lr} | {approx:.3f} | {clip:.3f} | {fired} |", flush=True
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=at_least_one, default=300)
    parser.add_argument(
        "--kl-horizon",
        type=at_least_one,
        default=None,
        help="ppo.kl_horizon of every variant (default: the module's, 4 iterations' episodes = 256 here)",
    )
    parser.add_argument(
        "--warm-steps", type=at_least(0), default=30, help="supervised steps of the warm start"
    )
    parser.add_argument("--policy", default=str(ROOT / "checkpoints" / "tiny-digits"))
    parser.add_argument(
        "--only", type=at_least_one, nargs="*", default=None, help="variant numbers to run (1-based)"
    )
    parser.add_argument("--lr-sweep", action="store_true", help="only the learning-rate table")
    ns = parser.parse_args()
    if ns.lr_sweep:
        with tempfile.TemporaryDirectory() as tmp:
            lr_sweep(Path(tmp), ns.warm_steps)
        return
    print(f"{ns.iterations} iterations per variant, ppo.kl_horizon {ns.kl_horizon}, policy {ns.policy}")
    print(
        "| run | score first 10 % | best 10 % | last 10 % | KL last 10 % / max | KL within +-50 % "
        "| kl_coef at the end | approxkl, iteration 1 | guardrails |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        warm = str(warm_start(ns.policy, Path(tmp) / "warm", ns.warm_steps))
        for i, variant in enumerate(VARIANTS, 1):
            if ns.only and i not in ns.only:
                continue
            rows, stderr = fit(
                variant, warm if variant.warm else ns.policy, ns.iterations, ns.kl_horizon, Path(tmp) / str(i)
            )
            print(row(variant, rows, stderr), flush=True)
            for line in stderr.splitlines():
                if any(mark in line for mark in GUARDRAIL_MARKS.values()):
                    print(f"    {re.sub(r'^.*?UserWarning: ', '', line)[:400]}", flush=True)


if __name__ == "__main__":
    main()
