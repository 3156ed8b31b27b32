"""Settings under which training optimises another objective than the selfcheck's
``E[r] - beta KL(pi || pi_ref)``: a FAIL with one of them set is that setting doing what it does, not a
broken setup, and the command names it (``docs/selfcheck.md`` has each one's measured gap).

The KL term is the usual suspect. Its gradient must be that of the reverse KL of whole responses:
``-beta (log pi - log pi_ref)`` in every token's reward (``kl_placement: reward``, ``kl_estimator:
k1``) is. As a loss term, differentiated where the sampled tokens stand, an estimator's gradient is
another's: k1's is 0 in expectation (``E_pi grad log pi = 0``; the config refuses it), k2's is each
token's own reverse KL without its effect on the tokens after it, k3's (``pi_ref/pi - 1 -
log(pi_ref/pi)``) is each token's *forward* ``KL(pi_ref || pi)``: ``E_pi[(1 - pi_ref/pi) grad log pi]
= -E_pi_ref[grad log pi]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ppo.config import GenerationConfig, PPOConfig

_IN_THE_LOSS = {  # k1 in the loss is refused by PPOConfig
    "k2": (
        "its gradient is each token's own reverse KL, without how a token changes the KL of the tokens "
        "after it; objective/kl then logs (log pi/pi_ref)^2 / 2, not a KL"
    ),
    "k3": (
        "its gradient is each token's forward KL(pi_ref || pi), not the reverse KL of whole responses "
        "(GRPO's published loss, configs/grpo.yaml)"
    ),
}


@dataclass(frozen=True)
class OtherObjective:
    """A setting the run has that changes what it optimises.

    Attributes:
        setting: The options, as set (``ppo.kl_estimator k3, ppo.kl_placement loss``).
        why: What the setting optimises instead, in a few words.
    """

    setting: str
    why: str

    def line(self) -> str:
        return f"  {self.setting} optimises another objective: {self.why}"


def other_objectives(ppo: PPOConfig, generation: GenerationConfig) -> tuple[OtherObjective, ...]:
    """The settings of ``ppo`` and ``generation`` that make training optimise another objective."""
    found = []
    estimator = ppo.kl_estimator
    if ppo.kl_placement == "loss":
        setting = f"ppo.kl_estimator {estimator}, ppo.kl_placement loss"
        found.append(OtherObjective(setting, _IN_THE_LOSS[estimator]))
    elif estimator != "k1":
        why = (
            f"{estimator}'s per-token penalty in the reward is not log pi - log pi_ref, whose sum over a "
            "response is the KL of the objective"
        )
        found.append(OtherObjective(f"ppo.kl_estimator {estimator} (in the reward)", why))
    if ppo.score_norm:
        why = "the scores divided by their running std: the objective of another beta (beta x that std)"
        found.append(OtherObjective("ppo.score_norm", why))
    if ppo.score_clip is not None:
        clipped = OtherObjective(f"ppo.score_clip {ppo.score_clip:g}", "clipped scores are another reward")
        found.append(clipped)
    if generation.top_k or generation.top_p < 1.0:
        setting = f"generation.top_k {generation.top_k}, top_p {generation.top_p:g}"
        why = "sampling a truncated distribution while the trainer's log-probs are the full one's"
        found.append(OtherObjective(setting, why))
    return tuple(found)
