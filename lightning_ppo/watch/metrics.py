"""What a PPO iteration reports about its rollout, as TRL names it (pure tensor math).

Scores are reported as the reward returned them (``objective/scores``, ``objective/scores_std``),
whatever clipping or normalisation the update applies: a normalised score is always near 0 and
says nothing about whether the policy improves.

Per-sequence quantities (``objective/*``) are sums over a response's real tokens, averaged over
the batch; token statistics (``returns/*``, ``advantages/mean``) are masked means over real
response tokens. Padding never counts. The update's own statistics (``policy/*``, ``loss/*``,
``val/ratio``, ``val/clipfrac_avg``) come from ``functional.policy_loss``/``value_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.experience import Experience


def experience_metrics(
    exp: Experience,
    entropy: Tensor,
    ended: Tensor,
    kl_coef: float,
    with_critic: bool,
    reduce: F.Reduce | None = None,
) -> dict[str, Tensor]:
    """Statistics of one iteration's experience.

    Args:
        exp: The experience (its ``kl``, ``scores``, ``returns``, ``advantages``, ``values``).
        entropy: (B, R) per-token entropy of the rollout policy, 0 on padding.
        ended: (B,) whether each response emitted the stop token.
        kl_coef: The KL coefficient the rewards were built with.
        with_critic: Report ``val/explained_variance`` (only meaningful with a value model).
        reduce: Sums over the data-parallel ranks. ``objective/kl``, which steers the adaptive KL
            controller, is then the mean over every rank's kept responses, the same on all ranks.
    """
    mask = F.TokenMask.of(exp.response_mask)  # one complement and count for every mean below
    kl_per_response = exp.kl.sum(dim=1)
    non_score = -kl_coef * kl_per_response
    kept = mask.mask.any(dim=1)  # a dropped sample's mask is empty: it has no KL to average
    metrics = {
        "objective/kl": F.masked_mean(kl_per_response, kept, reduce=reduce),
        "objective/entropy": mask.zeroed(entropy).sum(dim=1).mean(),
        "objective/non_score_reward": non_score.mean(),
        "objective/rlhf_reward": (exp.scores + non_score).mean(),
        "returns/mean": mask.mean(exp.returns),
        "returns/std": F.masked_var(exp.returns, mask).sqrt(),
        "advantages/mean": mask.mean(exp.advantages),
        "response/length_mean": mask.mask.sum(dim=1).float().mean(),
        "response/eos_fraction": ended.float().mean(),
    }
    if with_critic:
        metrics["val/explained_variance"] = F.explained_variance(exp.values, exp.returns, mask)
    return metrics


def score_metrics(
    raw: Tensor,
    shaped: Tensor,
    dropped: Tensor,
    shaping: bool,
    reduce: F.Reduce | None = None,
    failed: Tensor | None = None,
) -> dict[str, Tensor]:
    """Mean and spread of the reward's own scores over the samples kept (not ``dropped``), over every
    rank's with ``reduce`` (a rank whose samples were all dropped then reports the others', not NaN).
    ``reward/dropped`` counts the rows the rewards dropped, not those ``failed`` before scoring (an
    environment's, counted in ``episode/*``).

    ``objective/scores_std`` next to ``objective/non_score_reward`` shows whether the reward's
    spread, which is all the policy can learn from, is small against the KL penalty.
    ``objective/scores_normalized`` (the clipped/normalised scores the update uses) only when
    ``shaping``.
    """
    kept = ~dropped
    metrics = {
        "objective/scores": F.masked_mean(raw, kept, reduce=reduce),
        "objective/scores_std": F.masked_var(raw, kept, unbiased=False, reduce=reduce).sqrt(),
        "reward/dropped": (dropped if failed is None else dropped & ~failed).float().sum(),
    }
    if shaping:
        metrics["objective/scores_normalized"] = F.masked_mean(shaped, kept, reduce=reduce)
    return metrics


# The statistics the host decides on each iteration: the KL controller, the smoothed score, the
# guardrails (lightning_ppo.watch.guardrails).
HOST_STATS = (
    "objective/scores",
    "objective/kl",
    "objective/entropy",
    "response/length_mean",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
)


# Statistics computed over every rank's data already (with ``reduce``): the same on every rank, so
# they are logged as they are, not averaged again.
OVER_RANKS = frozenset(
    {
        "objective/kl",
        "objective/scores",
        "objective/scores_std",
        "objective/scores_normalized",
        "episode/turns_mean",
        "episode/tokens_mean",
        "episode/truncated",
        "episode/env_errors",
        "episode/tool_calls",
        "episode/tool_errors",
        # from every rank's answers (watch/every_rank.py)
        "diversity/top_share",
        "diversity/distinct_1",
        "diversity/distinct_2",
        "diversity/overlap",
    }
)


@dataclass
class HostView:
    """An iteration's numbers as the host sees them, read from the device in one read (one sync on
    GPUs, where a ``float()`` of each would be one each): the :data:`HOST_STATS` it decides on (this
    rank's), which optimizer steps were taken, each sample's score and KL, the spread of the rewards
    the update used (``None`` with fewer than two samples), whether an environment's rewards were
    among them, and every statistic as logged."""

    stats: dict[str, float]
    stepped: list[bool]
    scores: list[float]
    kl: list[float]
    scores_std: float | None
    environment_rewards: bool
    # every statistic, averaged over the ranks (but :data:`OVER_RANKS`) as ``log(sync_dist=True)``
    # would average each: here one collective for all of them
    logged: dict[str, float]

    @classmethod
    def read(
        cls,
        stats: dict[str, Tensor],
        stepped: Tensor,
        scores: Tensor,
        kl: Tensor,
        used: Tensor,
        kept: Tensor,
        mean: F.Reduce | None = None,
        total: F.Reduce | None = None,
        turn_rewards: Tensor | None = None,
    ) -> HostView:
        """``stats`` (at least :data:`HOST_STATS`, scalars), ``stepped`` (steps,), ``scores`` and ``kl``
        (B,) as the host sees them; ``used`` (B,) the scores the update used where ``kept``, and
        ``turn_rewards`` (B, R) an environment's rewards, which reach the advantages beside them;
        ``mean`` averages over the data-parallel ranks and ``total`` sums (``None``: one process):
        the spread the guardrails judge is every rank's, of every reward the update used."""
        environment = torch.zeros_like(used) if turn_rewards is None else turn_rewards.sum(1).to(used)
        spread = F.masked_var(used + environment, kept, unbiased=False, reduce=total).sqrt()
        counts = torch.stack([kept.sum().float(), environment.abs().masked_fill(~kept, 0.0).sum().float()])
        counts = counts if total is None else total(counts)
        names = sorted(stats, key=lambda name: name in OVER_RANKS)  # this rank's own first
        own = sum(name not in OVER_RANKS for name in names)
        # float32 holds every float32, bf16 and fp16 value exactly (scores are float32: check_scores)
        scalars = torch.cat([torch.stack([stats[name].float() for name in names] + [spread.float()]), counts])
        averaged = [] if mean is None else [mean(scalars[:own])]
        flat = torch.cat([scalars, *averaged, stepped.float(), scores.float(), kl.float()]).tolist()
        values, rest = flat[: len(names)], flat[len(scalars) :]
        spread_value, count, environment_total = flat[len(names) : len(scalars)]
        local = dict(zip(names, values, strict=True))
        logged = dict(local)
        if mean is not None:
            logged.update(zip(names[:own], rest[:own], strict=True))
            rest = rest[own:]
        steps = len(stepped)
        return cls(
            stats={name: local[name] for name in HOST_STATS},
            stepped=[bool(flag) for flag in rest[:steps]],
            scores=rest[steps : steps + len(scores)],
            kl=rest[steps + len(scores) :],
            scores_std=spread_value if count >= 2 else None,
            environment_rewards=environment_total > 0,
            logged={name: logged[name] for name in stats},  # in the order they were computed
        )


def reward_drowned(scores_std: float, kl_coef: float) -> bool:
    """Whether the scores vary by less than ``kl_coef``: then the KL penalty, not the reward, decides.

    The KL-regularised objective E[r] - kl_coef x KL is maximised by pi_ref x exp(r / kl_coef), whose
    mean score exceeds the reference's by about Var(r) / kl_coef while that tilt is small: with a
    spread under kl_coef, less than the spread itself, and learning looks flat. (A spread of 0 is
    no scale problem: nothing varies yet, as with a sparse reward at the start.)
    """
    return 0 < scores_std < kl_coef


# Iterations ``objective/scores_smoothed`` averages over: long enough that a lucky batch does not
# pick the best checkpoint, short enough to follow a run of a few hundred iterations.
SMOOTHING_WINDOW = 10


class TrailingMean:
    """Mean of the last ``window`` values added: ``objective/scores_smoothed``, the score a best
    checkpoint is chosen on (one batch's mean is noisy: the best single batch is mostly luck).

    Its values are saved with checkpoints, so a resumed run smooths as the uninterrupted one does.
    """

    def __init__(self, window: int = SMOOTHING_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.values: list[float] = []

    def add(self, value: float) -> float:
        """Add ``value``; the mean of the last ``window`` values (fewer at the start)."""
        self.values = [*self.values, value][-self.window :]
        return sum(self.values) / len(self.values)

    def state_dict(self) -> dict[str, list[float]]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.values = list(state["values"])[-self.window :]
