"""Guardrails: one-time warnings that speak before a run is wasted.

Each check watches one symptom of a run going wrong, and says once which metric, its value and
what to do, with advice that matches the configuration (it never suggests a setting that is
already on). Pure Python on the iteration's statistics and decoded responses, every rank's (the same on
each rank): the module passes them in, and :meth:`Guardrails.heed` warns (on rank 0) with
whatever comes back, as ``lightning-ppo: warning: MESSAGE`` (lightning_ppo.runs.warn).

The thresholds come from a user's collapsed run (a warm-started policy at torch's default lr
1e-3: approxkl 4.5 and clipfrac 0.55 at iteration 1, every answer ``'admin.'``, then ``''``,
kl_coef driven from 0.05 to 690) against the quickstart run, which stays below them throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_ppo.config import PPOConfig
from lightning_ppo.runs.warn import warn
from lightning_ppo.watch.diversity import Diversity
from lightning_ppo.watch.metrics import HostView, reward_drowned

# PPO's trust region: approx-KL 0.5 (log r)^2 near 0.01-0.05 and clip fractions near 0.1-0.2 are
# usual; a step that leaves these far behind in the first iterations is a learning rate too large.
APPROX_KL_LIMIT = 1.0
CLIPFRAC_LIMIT = 0.4
EARLY_ITERATIONS = 10
# Iterations in a row whose responses were all identical (or all empty) before warning.
COLLAPSE_ITERATIONS = 3
# How far the adaptive kl_coef may move from its start before the run is told.
KL_COEF_FACTOR = 10.0
# Iterations of score spread averaged before judging the reward's scale against kl_coef.
SPREAD_ITERATIONS = 5
# Entropy collapse: the per-token entropy, averaged over windows of this many iterations, below this
# share of the first window's, while the score has not risen above the first window's.
ENTROPY_WINDOW = 5
ENTROPY_FLOOR = 0.1
# Converging answers: this share of a batch's distinct prompts (at least CONVERGE_PROMPTS of them)
# given one answer, CONVERGE_ITERATIONS in a row, while the score is above the first window's.
CONVERGE_SHARE = 0.5
CONVERGE_PROMPTS = 4
CONVERGE_ITERATIONS = 3
# Near-copies count too (diversity.Diversity.shared): a part shared by the answers of CONVERGE_SHARE
# of the prompts that makes up this share of them, or a mean word overlap (Jaccard) this high between
# answers to different prompts. A user's sentence-reward run (answers of different first words, 13 of
# 16 ending in the same five words; diversity/overlap 0.03 -> 0.70) passes both; the quickstart runs
# share nothing (digit answers of one "word", overlap near 0).
SHARED_COVER = 0.5
OVERLAP_LIMIT = 0.5
QUOTE_CHARS = 80
# Steps too small to matter: from this iteration on, a policy still within this KL of the reference
# per response, and PPO's own step (approx-KL) below this, while the scores vary.
SMALL_STEP_ITERATIONS = 50
SMALL_STEP_KL = 0.1
SMALL_STEP_APPROX_KL = 1e-3
# The learning rates the advice names as usual, by kind of model (name, low, high, as said). A rate inside one
# of them is not called too small (a pretrained policy at 1e-5 that is slow to start is no fault of
# its rate), and only the kinds whose rates lie above it are named.
USUAL_LR = (
    ("random or tiny models", 1e-4, 1e-3, "1e-4 to 1e-3"),
    ("pretrained models", 1e-6, 1e-5, "1e-6 to 1e-5"),
    ("LoRA", 5e-5, 2e-4, "about 1e-4"),
)


@dataclass
class IterationView:
    """What the guardrails read of one iteration (plain floats and the decoded responses)."""

    iteration: int
    completions: list[str]
    approx_kl: float
    clipfrac: float
    kl: float
    kl_coef: float
    kl_coef_pinned: bool
    # the adaptive controller's slow part (the coefficient without its answer to this iteration's KL)
    kl_coef_base: float
    # batch std of every reward the update uses (scores and an environment's); None with fewer than 2
    scores_std: float | None
    entropy: float = float("nan")  # the rollout policy's entropy per response token
    score: float = float("nan")  # objective/scores
    diversity: Diversity | None = None  # every rank's answers (watch/diversity.py, watch/every_rank.py)
    environment_rewards: bool = False  # an environment's rewards were among them (not ppo.score_norm's)

    @classmethod
    def of(
        cls, iteration: int, completions: list[str], host: HostView, kl_ctl: Any, diversity: Diversity | None
    ) -> IterationView:
        """The view of an iteration from its statistics as logged (over every rank, the same on each:
        a warning judges the run, not rank 0's part of it), ``completions`` and ``diversity`` of every
        rank's answers, and the KL controller."""
        stats = host.logged
        return cls(
            iteration=iteration,
            diversity=diversity,
            completions=completions,
            approx_kl=stats["policy/approxkl_avg"],
            clipfrac=stats["policy/clipfrac_avg"],
            kl=stats["objective/kl"],
            kl_coef=kl_ctl.value,
            kl_coef_pinned=kl_ctl.pinned,
            kl_coef_base=getattr(kl_ctl, "integral", kl_ctl.value),
            scores_std=host.scores_std,
            environment_rewards=host.environment_rewards,
            entropy=stats["objective/entropy"] / max(stats["response/length_mean"], 1.0),
            score=stats["objective/scores"],
        )


@dataclass
class Guardrails:
    """Watches the run; :meth:`observe` returns the warnings due this iteration (each at most once)."""

    config: PPOConfig
    lr: float
    fired: set[str] = field(default_factory=set)
    collapsed_in_a_row: int = 0
    # A running sum, not a list of every iteration's spread: a run that never warns keeps no history.
    spread_sum: float = 0.0
    spread_count: int = 0
    # (entropy per token, score) of the first ENTROPY_WINDOW iterations, and of the latest ones
    early: list[tuple[float, float]] = field(default_factory=list)
    recent: list[tuple[float, float]] = field(default_factory=list)
    converging_in_a_row: int = 0
    # whether an environment's rewards were ever among those the update used: ppo.score_norm would
    # then scale the reward's scores against them, so the advice never names it
    environment_rewards: bool = False

    def heed(self, view: IterationView) -> None:
        """Warn, on rank 0, with each warning due this iteration."""
        for message in self.observe(view):
            warn(message)

    def observe(self, view: IterationView) -> list[str]:
        self.environment_rewards |= view.environment_rewards
        checks = (
            self._trust_region,
            self._collapse,
            self._entropy,
            self._kl_coef,
            self._reward_drowned,
            self._converging,
            self._small_steps,
        )
        return [m for m in (check(view) for check in checks) if m is not None]

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to warn as the uninterrupted one does (plain values: checkpoints
        load with ``weights_only=True``): which warnings were given, the counts in a row, the running
        spread and the windows of the run's start and its latest iterations."""
        return {
            "lr": self.lr,
            "fired": sorted(self.fired),
            "collapsed_in_a_row": self.collapsed_in_a_row,
            "spread_sum": self.spread_sum,
            "spread_count": self.spread_count,
            "early": [list(pair) for pair in self.early],
            "recent": [list(pair) for pair in self.recent],
            "converging_in_a_row": self.converging_in_a_row,
            "environment_rewards": self.environment_rewards,
        }

    @classmethod
    def restored(cls, config: PPOConfig, state: dict[str, Any]) -> Guardrails:
        """Inverse of :meth:`state_dict`, watching a run with ``config``."""
        return cls(
            config,
            lr=state["lr"],
            fired=set(state["fired"]),
            collapsed_in_a_row=state["collapsed_in_a_row"],
            spread_sum=state["spread_sum"],
            spread_count=state["spread_count"],
            early=[(entropy, score) for entropy, score in state["early"]],
            recent=[(entropy, score) for entropy, score in state["recent"]],
            converging_in_a_row=state["converging_in_a_row"],
            environment_rewards=state.get("environment_rewards", False),  # saved since issue 49
        )

    def _once(self, name: str, message: str) -> str | None:
        if name in self.fired:
            return None
        self.fired.add(name)
        return message

    def _trust_region(self, view: IterationView) -> str | None:
        if view.iteration > EARLY_ITERATIONS:
            return None
        if view.approx_kl <= APPROX_KL_LIMIT and view.clipfrac <= CLIPFRAC_LIMIT:
            return None
        return self._once(
            "trust_region",
            f"policy/approxkl_avg {view.approx_kl:.3g} and policy/clipfrac_avg {view.clipfrac:.3g} at "
            f"iteration {view.iteration}: each optimizer step moves the policy far outside PPO's clip "
            f"range ({self.config.clip_range}). The learning rate {self.lr:g} is too large for this "
            "model: fine-tuning a pretrained model usually wants 1e-6 to 1e-5 (LoRA about 1e-4); set "
            "model.optimizer.init_args.lr",
        )

    def _collapse(self, view: IterationView) -> str | None:
        responses = view.completions
        collapsed = len(responses) >= 4 and len(set(responses)) == 1
        self.collapsed_in_a_row = self.collapsed_in_a_row + 1 if collapsed else 0
        if self.collapsed_in_a_row < COLLAPSE_ITERATIONS:
            return None
        what = "empty" if responses[0] == "" else f"the same text {responses[0][:40]!r}"
        return self._once(
            "collapse",
            f"response collapse: all {len(responses)} responses of each of the last "
            f"{COLLAPSE_ITERATIONS} iterations were {what} (objective/kl {view.kl:.3g}). The policy has "
            f"lost its variety and will not recover on its own: {self._restart_advice()}",
        )

    def _entropy(self, view: IterationView) -> str | None:
        """The policy grows certain (entropy per token down to a tenth) without growing better: a
        collapse onto a few answers that the reward does not explain. A run that learns also grows
        certain, but its score rose."""
        pair = (view.entropy, view.score)
        if len(self.early) < ENTROPY_WINDOW:
            self.early.append(pair)
            return None
        self.recent = [*self.recent, pair][-ENTROPY_WINDOW:]
        if len(self.recent) < ENTROPY_WINDOW:
            return None
        start_entropy, start_score = (sum(x) / ENTROPY_WINDOW for x in zip(*self.early, strict=True))
        entropy, score = (sum(x) / ENTROPY_WINDOW for x in zip(*self.recent, strict=True))
        if not (entropy < ENTROPY_FLOOR * start_entropy and score <= start_score):
            return None
        return self._once(
            "entropy",
            f"objective/entropy fell to {entropy:.3g} nats per response token from {start_entropy:.3g} at "
            f"the start while objective/scores did not rise ({start_score:.3g} -> {score:.3g}): the policy "
            f"is collapsing onto a few answers the reward does not prefer. {self._restart_advice()}, or "
            "set ppo.entropy_coef",
        )

    def _kl_coef(self, view: IterationView) -> str | None:
        if self.config.kl_target is None:
            return None
        start = self.config.kl_coef
        # The slow part, not the coefficient itself: its proportional part may triple it for an
        # iteration (a KL three times the target) on a run that is fine.
        base = view.kl_coef_base
        grown = base > KL_COEF_FACTOR * start or base * KL_COEF_FACTOR < start
        if not (view.kl_coef_pinned or grown):
            return None
        where = "at its bound" if view.kl_coef_pinned else f"{base / start:.3g}x its start"
        return self._once(
            "kl_coef",
            f"kl_coef {base:.3g} is {where} ({start} at the start; bounds ppo.kl_coef_min "
            f"{self.config.kl_coef_min}, ppo.kl_coef_max {self.config.kl_coef_max}) while objective/kl is "
            f"{view.kl:.3g} against ppo.kl_target {self.config.kl_target}: "
            + (
                "the policy moves faster than the penalty can pull it back. " + self._restart_advice()
                if view.kl > self.config.kl_target
                else f"{self._rewards_give} the policy too little reason to move: raise the {self._scale}"
                + (" or set ppo.score_norm: true" if self._score_norm_helps else "")
            ),
        )

    def _reward_drowned(self, view: IterationView) -> str | None:
        """The scores vary by less than kl_coef: the KL-regularised optimum barely leaves the reference.

        Only where the reward's scale competes with the KL term: a KL in the reward, or a KL in the
        loss beside advantages that are not normalised (rloo, gae without whitening).
        """
        if view.scores_std is None or self._scale_free():
            return None
        self.spread_sum += view.scores_std
        self.spread_count += 1
        spread = self.spread_sum / self.spread_count
        if self.spread_count < SPREAD_ITERATIONS or not reward_drowned(spread, view.kl_coef):
            return None
        remedies = ["scale the rewards up" if self.environment_rewards else "scale the reward up"]
        if self._score_norm_helps:
            remedies.append("set ppo.score_norm: true")
        remedies.append("lower ppo.kl_coef" if self.config.kl_target is None else "lower ppo.kl_target")
        return self._once(
            "reward_drowned",
            f"{self._used} vary by {spread:.3g} (batch std, mean of {self.spread_count} "
            f"iterations), less than the KL coefficient {view.kl_coef:.3g}: the KL-regularised optimum "
            f"lies within about {spread**2 / view.kl_coef:.2g} of the reference's mean score, so the "
            f"score will stay flat. {', '.join(remedies).capitalize()} "
            "(docs/algorithms.md: reward scale and KL)",
        )

    def _converging(self, view: IterationView) -> str | None:
        """Many different prompts get one answer, or near-copies of one (a long shared part, most of
        the words in common), while the score rises: the policy has found a phrase the reward likes
        (reward hacking), which a rising score alone hides."""
        d = view.diversity
        early = [score for _, score in self.early]  # the first window, which _entropy records
        what = None if d is None or d.prompts < CONVERGE_PROMPTS else _converged_on(d)
        self.converging_in_a_row = self.converging_in_a_row + 1 if what is not None else 0
        if self.converging_in_a_row < CONVERGE_ITERATIONS or len(early) < ENTROPY_WINDOW:
            return None
        start = sum(early) / len(early)
        if what is None or not view.score > start:
            return None
        return self._once(
            "converging",
            f"answers are converging: {what} at iteration {view.iteration} while objective/scores rose "
            f"from {start:.3g} to {view.score:.3g}: the policy may be exploiting the reward rather than "
            "answering. Read the answers (lightning-ppo samples RUN_DIR) and check whether the reward pays "
            f"for that text rather than for what you meant; {self._nearer_the_reference()}, or make the "
            "reward penalise repeated answers",
        )

    def _nearer_the_reference(self) -> str:
        """Advice that keeps the policy nearer the reference and its answers varied, naming only
        settings that would change (a larger entropy bonus where one is set, a KL target if any)."""
        kl = (
            f"raise ppo.kl_coef (now {self.config.kl_coef:g}) or set a ppo.kl_target"
            if self.config.kl_target is None
            else f"lower ppo.kl_target (now {self.config.kl_target:g})"
        )
        entropy = (
            f"raise ppo.entropy_coef (now {self.config.entropy_coef:g})"
            if self.config.entropy_coef > 0
            else "set ppo.entropy_coef (e.g. 0.01)"
        )
        return (
            f"to keep the policy nearer the reference {kl}, {entropy}, or lower the learning rate "
            f"(now {self.lr:g}; model.optimizer.init_args.lr)"
        )

    def _small_steps(self, view: IterationView) -> str | None:
        """After a warm-up the policy has barely left the reference though the scores vary: steps
        too small to matter, usually a learning rate meant for another kind of model. Not while the
        KL penalty is what keeps the policy there (a fixed or an adaptive coefficient that outweighs
        what the policy learns from, or a KL near ppo.kl_target): a smaller step would not move it
        either. Not for a rate inside a range the advice names as usual."""
        # _reward_drowned's running spread where it keeps one (not beside a KL in the loss), else this batch's
        spread = self.spread_sum / self.spread_count if self.spread_count else (view.scores_std or 0.0)
        if view.iteration < SMALL_STEP_ITERATIONS or not spread > 0:
            return None
        if view.kl >= SMALL_STEP_KL or view.approx_kl >= SMALL_STEP_APPROX_KL:
            return None
        above = [f"{name} {said}" for name, low, _, said in USUAL_LR if low > self.lr]
        usual_already = any(low <= self.lr <= high for _, low, high, _ in USUAL_LR)
        if self._penalty_holds(view, spread) or usual_already or not above:
            return None
        return self._once(
            "small_steps",
            f"objective/kl {view.kl:.3g} and policy/approxkl_avg {view.approx_kl:.2g} at iteration "
            f"{view.iteration} while the {self._varied} vary (std {spread:.3g}): the policy has barely moved "
            f"from the reference, and the KL penalty (kl_coef {view.kl_coef:.3g}) is too weak to be what "
            f"holds it. The learning rate {self.lr:g} is likely too small for this model (usual rates: "
            f"{', '.join(above)}); set model.optimizer.init_args.lr",
        )

    def _penalty_holds(self, view: IterationView, spread: float) -> bool:
        """Whether the KL penalty, not the step size, keeps the policy near the reference: its
        coefficient is at least the spread of what the policy learns from (the scores, or advantages
        of unit spread beside a KL in the loss), or an adaptive controller has raised it above its start
        (pulling the policy back) or has the KL near its target."""
        adaptive = self.config.kl_target is not None
        if adaptive and (view.kl_coef_base > self.config.kl_coef or view.kl >= self.config.kl_target / 2):
            return True
        return view.kl_coef >= (1.0 if self._scale_free() else spread)

    def _scale_free(self) -> bool:
        """A KL in the loss beside advantages normalised to unit spread: the reward's scale does not
        compete with the KL coefficient (grpo, reinforce_pp, gae with whitening)."""
        normalised = self.config.advantage_estimator in ("grpo", "reinforce_pp") or (
            self.config.advantage_estimator == "gae" and self.config.whiten_advantages
        )
        return self.config.kl_placement == "loss" and normalised

    @property
    def _used(self) -> str:
        """What the spread the checks judge is of, said in a warning."""
        if self.environment_rewards:
            return "the rewards the update uses (the reward's scores and the environment's)"
        return "the scores the update uses"

    @property
    def _varied(self) -> str:
        return "rewards" if self.environment_rewards else "scores"

    @property
    def _score_norm_helps(self) -> bool:
        """Whether ppo.score_norm is off and would scale all the rewards: not an environment's."""
        return not self.config.score_norm and not self.environment_rewards

    @property
    def _rewards_give(self) -> str:
        return "the rewards give" if self.environment_rewards else "the reward gives"

    @property
    def _scale(self) -> str:
        return "rewards' scale" if self.environment_rewards else "reward's scale"

    def _restart_advice(self) -> str:
        return (
            f"restart from an earlier checkpoint with a smaller learning rate (now {self.lr:g}; "
            "model.optimizer.init_args.lr)"
            + ("" if self.config.kl_target is not None else " or a larger ppo.kl_coef / a ppo.kl_target")
        )


def _converged_on(d: Diversity) -> str | None:
    """What a batch's answers converged on, said for the warning (None if they did not): one answer
    given to :data:`CONVERGE_SHARE` of the distinct prompts, a shared part (:attr:`Diversity.shared`)
    in the answers of as many that is at least :data:`SHARED_COVER` of them, or answers to different
    prompts that share :data:`OVERLAP_LIMIT` of their words on average."""
    if d.top_share >= CONVERGE_SHARE:
        return (
            f"{d.top_share:.0%} of the batch's {d.prompts} different prompts got the same answer "
            f"({d.top_answer[:60]!r})"
        )
    near_copies = d.shared_share >= CONVERGE_SHARE and d.shared_cover >= SHARED_COVER
    overlapping = d.overlap >= OVERLAP_LIMIT
    readings = f"diversity/overlap {d.overlap:.2f}, diversity/distinct_1 {d.distinct_1:.2f}"
    if near_copies or (overlapping and d.shared):
        return (
            f"the answers to {d.shared_share:.0%} of the batch's {d.prompts} different prompts are "
            f"near-copies sharing {_quote(d.shared)} ({d.shared_cover:.0%} of each such answer; {readings})"
        )
    if overlapping:  # the same words, not in one run of text
        return (
            f"answers to the batch's {d.prompts} different prompts share {d.overlap:.0%} of their words on "
            f"average ({readings}; one of them: {_quote(d.top_answer)})"
        )
    return None


def _quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` quoted, its middle cut where it is longer than ``limit`` (its start and end both
    say what the policy converged on: a shared opening, a shared ending)."""
    text = text.strip()
    if len(text) <= limit:
        return repr(text)
    half = (limit - 3) // 2
    return repr(f"{text[:half].rstrip()} ... {text[-half:].lstrip()}")
