"""``lightning-ppo selfcheck``: prove that training lands on the exact KL-regularised optimum.

For the objective ``E[r] - beta KL(pi || pi_ref)`` the optimum is ``pi* ∝ pi_ref exp(r / beta)``. On
a task small enough to list every response (:mod:`.task`, :mod:`.responses`), its expected reward
and KL are exact sums (:mod:`.exact`). The selfcheck trains that task with the user's Trainer and
model options through ``lightning-ppo fit`` (:mod:`.run`), reads where the run's own logged
``objective/scores`` and ``objective/kl`` settled, and passes when both lie within a band that
sampling noise and a small allowance for the optimiser explain (:mod:`.verdict`,
``docs/selfcheck.md``), and when the responses it sampled are likely under the policy it claims
sampled them, not one update older (:mod:`.sampling`, collected by :mod:`.recorder`).

The selfcheck sits above the public face: it fits through the CLI's in-process entry point, as a
user runs the command. ``cli`` reaches it through :mod:`.command` and hands it that function;
:func:`selfcheck` imports ``lightning_ppo.cli.fit_in_process`` when called.
"""

from __future__ import annotations

from pathlib import Path

from lightning_ppo.selfcheck.result import SelfcheckResult
from lightning_ppo.selfcheck.run import RunSettings
from lightning_ppo.selfcheck.task import SelfcheckTask

__all__ = ["RunSettings", "SelfcheckResult", "SelfcheckTask", "selfcheck"]


def selfcheck(
    out: str | Path,
    *overrides: str,
    iterations: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    task: SelfcheckTask | None = None,
    window: int | None = None,
    draw: bool = True,
) -> SelfcheckResult | None:
    """Run the selfcheck in this process and return its result (``None`` on a rank other than 0).

    Args:
        out: The folder of the run (its policy, config, logs and plot).
        *overrides: ``lightning-ppo fit`` options for the Trainer and the model, e.g.
            ``"--trainer.precision", "bf16-mixed"``, ``"--model.init_args.ppo.advantage_estimator", "rloo"``.
        iterations, batch_size, lr: The training's length, batch and learning rate (defaults:
            :class:`RunSettings`).
        task: The task (default :class:`SelfcheckTask`).
        window: Iterations the plateau averages (default a third of ``iterations``).
        draw: Write ``out/selfcheck.png``.
    """
    from lightning_ppo.cli import fit_in_process  # the public face: it reaches only .command
    from lightning_ppo.selfcheck.check import run_selfcheck

    given = {"iterations": iterations, "batch_size": batch_size, "lr": lr, "task": task}
    settings = RunSettings(
        Path(out), overrides=list(overrides), **{k: v for k, v in given.items() if v is not None}
    )
    return run_selfcheck(settings, fit_in_process, window, draw)
