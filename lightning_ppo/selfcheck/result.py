"""What a selfcheck found: the exact optimum, where the run settled, and the verdict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_ppo.selfcheck.exact import TiltedOptimum
from lightning_ppo.selfcheck.objective import OtherObjective
from lightning_ppo.selfcheck.sampling import NOT_CHECKED, SamplingCheck
from lightning_ppo.selfcheck.verdict import EPSILON, Check, Z


@dataclass(frozen=True)
class SelfcheckResult:
    """The outcome of ``lightning-ppo selfcheck`` (exit status 0 when :attr:`passed`, else 1).

    Attributes:
        setup: The settings checked, in words (accelerator, devices, strategy, precision, engine, ...).
        optimum: The exact optimum at the run's beta, and where training started and greedy would end.
        reward: ``objective/scores`` over the plateau against the optimum's expected reward.
        kl: ``objective/kl`` over the plateau against the optimum's KL from the reference.
        objective: ``objective/scores - beta objective/kl`` over the plateau against the maximum.
        iterations: Iterations in the plateau.
        responses: Responses sampled over the plateau, every rank's.
        policy_distance: The trained policy's exact ``KL(pi || pi*)`` in nats at the end (``None`` where its
            weights are sharded): how far it ended from the optimum, without sampling noise.
        seconds: Wall time of the whole check (building the task, training, judging).
        metrics: The run's ``metrics.csv``.
        plot: The picture of the run against the optimum (``None`` if not drawn).
        stopped: Why the run stopped before its end (a FAIL: ``ppo.max_consecutive_skips`` NaN/inf
            steps in a row), else ``None``; the fields above are then ``None`` or empty.
        other_objectives: The run's settings that optimise another objective than
            ``E[r] - beta KL(pi || pi_ref)`` (a FAIL names them).
        sampling: Whether the responses came from the policy the run claims sampled them, not one
            update older (:mod:`lightning_ppo.selfcheck.sampling`); ``None``: not checked (two turns).
    """

    setup: str
    optimum: TiltedOptimum | None
    reward: Check | None
    kl: Check | None
    objective: Check | None
    iterations: int
    responses: int
    policy_distance: float | None
    seconds: float
    metrics: Path | None
    plot: Path | None = None
    stopped: str | None = None
    other_objectives: tuple[OtherObjective, ...] = ()
    sampling: SamplingCheck | None = None

    @property
    def passed(self) -> bool:
        checks = (self.reward, self.kl, self.objective)
        sampled = self.sampling is None or self.sampling.passed
        plateau = all(check is not None and check.passed for check in checks)
        return self.stopped is None and plateau and sampled

    def to_json(self) -> str:
        """Every field (paths as text), with ``passed`` and each check's ``gap`` and ``passed``."""
        fields = asdict(self)
        for name in ("reward", "kl", "objective"):
            check = getattr(self, name)
            if check is not None:
                fields[name].update(gap=check.gap, passed=check.passed)
        if self.sampling is not None:
            fields["sampling"].update(z=self.sampling.z, passed=self.sampling.passed)
        fields["passed"] = self.passed
        return json.dumps(fields, indent=1, default=str)

    def lines(self) -> list[str]:
        """What the command prints."""
        if self.stopped is not None:
            return [
                f"selfcheck ({self.setup}): FAIL in {self.seconds:.0f} s: the run stopped: {self.stopped}"
            ]
        o = self.optimum
        distance = (
            "" if self.policy_distance is None else f"; final policy {self.policy_distance:.4f} nats from it"
        )
        return [
            f"selfcheck ({self.setup}): beta {o.beta:g}, plateau of the last {self.iterations} iterations "
            f"({self.responses} responses)",
            f"  optimum: E[r] {o.reward:.4f} (reference {o.reference_reward:.4f}, "
            f"greedy {o.greedy_reward:.4f}), KL {o.kl:.4f} nats{distance}",
            self.reward.line(),
            self.kl.line(),
            self.objective.line(),
            NOT_CHECKED if self.sampling is None else self.sampling.line(),
            *([] if self.passed else [other.line() for other in self.other_objectives]),
            f"  objective = objective/scores - beta objective/kl; bands: {Z:g} standard errors of sampling "
            f"noise + what a policy {EPSILON:g} nats from the optimum moves (docs/selfcheck.md)",
            f"{'PASS' if self.passed else 'FAIL'} in {self.seconds:.0f} s; log {self.metrics}"
            + ("" if self.plot is None else f"; plot {self.plot}"),
        ]
