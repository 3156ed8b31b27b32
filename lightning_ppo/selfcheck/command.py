"""``lightning-ppo selfcheck [OPTIONS] [--trainer.* ...] [--model.* ...]``: exit 0 on PASS, 1 on FAIL,
2 on a usage error (one line)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_ppo.runs.errors import UsageError
from lightning_ppo.selfcheck.check import run_selfcheck
from lightning_ppo.selfcheck.run import RunSettings
from lightning_ppo.selfcheck.task import SelfcheckTask

PASS_STATUS, FAIL_STATUS = 0, 1
_DEFAULTS = RunSettings("runs/selfcheck")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ppo selfcheck",
        description=(
            "Train a tiny task whose KL-regularised optimum is known exactly, with your Trainer and model "
            "options (--trainer.accelerator/devices/strategy/precision, --model.init_args.generation.engine, "
            "--model.init_args.ppo.advantage_estimator, --model.init_args.lora, ...), and check that "
            "objective/scores and objective/kl settle on it (docs/selfcheck.md). Exit 0: PASS, 1: FAIL."
        ),
        allow_abbrev=False,  # --trainer.* / --model.* pass through untouched
        exit_on_error=False,
    )
    parser.add_argument("--out", default=str(_DEFAULTS.out), help="the run's folder (default %(default)s)")
    parser.add_argument(
        "--iterations", type=int, default=None, help="PPO iterations (default 120, 200 for --turns 2)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=_DEFAULTS.batch_size, help="prompts per batch per rank"
    )
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="AdamW's learning rate")
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        choices=(1, 2),
        help="1: one reply per prompt; 2: two replies and an environment's random hint between (an episode)",
    )
    parser.add_argument(
        "--raters",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: one prompt whose rows two raters the policy cannot tell apart score in turn, on scales 1 "
        "and 3 (on 2 ranks each rank gets one rater's rows: checks that the ranks' samples weigh alike)",
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=None,
        help="the KL coefficient (default the task's: 0.3, 0.5 for --turns 2)",
    )
    parser.add_argument(
        "--seed", type=int, default=SelfcheckTask.seed, help="the policy's and the run's seed"
    )
    parser.add_argument("--window", type=int, default=None, help="plateau iterations (default a third)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw OUT/selfcheck.png")
    return parser


def selfcheck_main(argv: list[str], fit: Callable[[list[str]], Any]) -> int:
    """Parse, run and print the selfcheck; its exit status. ``fit`` runs ``lightning-ppo fit ARGS``
    in-process, raising usage errors (``lightning_ppo.cli``)."""
    try:
        ns, overrides = parser().parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise UsageError(f"selfcheck: {err}") from err
    if ns.beta is not None and ns.beta <= 0:
        raise UsageError(f"selfcheck: --beta must be > 0, got {ns.beta}")
    if ns.turns == 2 and ns.raters == 2:
        raise UsageError("selfcheck: --raters 2 is a one-turn task: drop --turns 2 or --raters 2")
    task = SelfcheckTask.two_raters() if ns.raters == 2 else SelfcheckTask()
    task = SelfcheckTask.two_turns() if ns.turns == 2 else task
    task = replace(task, seed=ns.seed, **({} if ns.beta is None else {"beta": ns.beta}))
    settings = RunSettings(ns.out, ns.iterations, ns.batch_size, ns.lr, task, overrides)
    if ns.window is not None and not 2 <= ns.window <= settings.iterations:
        raise UsageError(
            f"selfcheck: --window must be in [2, --iterations {settings.iterations}], got {ns.window}"
        )
    result = run_selfcheck(settings, fit, ns.window, draw=not ns.no_plot)
    if result is None:  # a rank other than 0: it trained, rank 0 judges
        return PASS_STATUS
    sys.stdout.write("\n".join(result.lines()) + "\n")  # the verdict is the command's output
    return PASS_STATUS if result.passed else FAIL_STATUS
