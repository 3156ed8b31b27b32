"""The selfcheck from end to end: train the task, compute its exact optimum, judge, draw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning_ppo.distributed.sharding import is_sharded
from lightning_ppo.runs.errors import RunStopped
from lightning_ppo.selfcheck.objective import other_objectives
from lightning_ppo.selfcheck.optimum import list_task
from lightning_ppo.selfcheck.plot import plot_selfcheck
from lightning_ppo.selfcheck.recorder import recorded
from lightning_ppo.selfcheck.result import SelfcheckResult
from lightning_ppo.selfcheck.run import FitOutcome, RunSettings, is_first_rank, run_fit
from lightning_ppo.selfcheck.verdict import Plateau, judge


def run_selfcheck(
    settings: RunSettings, fit: Callable[[list[str]], Any], window: int | None = None, draw: bool = True
) -> SelfcheckResult | None:
    """Train, then judge the plateau of the last ``window`` iterations (default a third of them).

    ``None`` on a rank other than 0, which only trains beside rank 0.
    """
    started = time.perf_counter()
    try:
        outcome = run_fit(settings, fit)
    except RunStopped as err:  # the setup broke training (NaN/inf steps in a row): that is a FAIL
        if not is_first_rank():
            return None
        setup = " ".join(settings.overrides) or "defaults"
        seconds = time.perf_counter() - started
        return kept(
            settings,
            SelfcheckResult(setup, None, None, None, None, 0, 0, None, seconds, None, None, str(err)),
        )
    if outcome is None:
        return None
    window = window or max(settings.iterations // 3, 4)
    module = outcome.module
    listed = list_task(module, settings.task)
    optimum = listed.optimum(float(module.ppo.kl_coef))
    plateau = Plateau.read(outcome.metrics, window)
    checks = judge(optimum, plateau)
    plot = None
    if draw:
        plot = plot_selfcheck(
            outcome.metrics, listed, optimum, checks, window, settings.out / "selfcheck.png"
        )
    result = SelfcheckResult(
        setup=describe(outcome),
        optimum=optimum,
        reward=checks[0],
        kl=checks[1],
        objective=checks[2],
        iterations=plateau.iterations,
        responses=plateau.responses,
        policy_distance=None if is_sharded(module) else listed.distance(module.policy, optimum.beta),
        seconds=time.perf_counter() - started,
        metrics=outcome.metrics,
        plot=plot,
        other_objectives=other_objectives(module.ppo, module.generation_config),
        sampling=recorded(module.trainer),
    )
    return kept(settings, result)


def kept(settings: RunSettings, result: SelfcheckResult) -> SelfcheckResult:
    """``result``, written to ``OUT/selfcheck.json`` too (for scripts and CI: ``make gpu-check`` reads it)."""
    (settings.out / "selfcheck.json").write_text(result.to_json())
    return result


def describe(outcome: FitOutcome) -> str:
    """The settings checked, in a few words."""
    module, trainer = outcome.module, outcome.module.trainer
    ppo, generation = module.ppo, module.generation_config
    words = [
        f"{type(trainer.accelerator).__name__.removesuffix('Accelerator').lower()} x {trainer.world_size}",
        type(trainer.strategy).__name__.removesuffix("Strategy"),
        str(trainer.precision),
        f"engine {generation.engine}",
        ppo.advantage_estimator,
    ]
    if module.episode_runner is not None:
        words.append("episodes")
    if ppo.max_staleness:
        words.append(f"max_staleness {ppo.max_staleness}")
    if module.hparams.get("lora") is not None:
        words.append("LoRA")
    if type(module).__name__ != "PPOLightningModule":
        words.append(type(module).__name__)
    return ", ".join(words)
