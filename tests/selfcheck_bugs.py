"""Known bugs, injected into a real ``PPOLightningModule`` by test-only subclasses that
``lightning-ppo selfcheck --model.class_path tests.selfcheck_bugs.<Bug>`` trains: the selfcheck
must FAIL each one (tests/test_selfcheck.py). Each changes one thing, as the bug it stands for would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ppo import PPOLightningModule
from lightning_ppo.module import RolloutForwards
from lightning_ppo.ppo.experience import Experience, make_experience
from lightning_ppo.ppo.kl import FixedKLController
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.prompts import PromptBatch


class WrongSignKL(PPOLightningModule):
    """The KL penalty added to the per-token rewards instead of subtracted (``+kl_coef x KL``): the
    policy is paid to move away from the reference."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kl_ctl = FixedKLController(-self.ppo.kl_coef)


class ReferenceIsPolicy(PPOLightningModule):
    """The reference's log-probs read from the policy being trained (a reference that follows the
    policy, as a LoRA reference read with the adapter on does): the KL is always 0."""

    def configure_model(self) -> None:
        super().configure_model()
        roles = self.roles

        def reference_logits(ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
            return roles.policy_forward(ids, mask, pos, length)[0]

        roles.reference_logits = reference_logits


class LogprobsShiftedByOne(PPOLightningModule):
    """Each position's logits score the previous response token instead of its own (the classic
    off-by-one between logits and labels; the first scores its own), in the rollout's log-probs, the
    reference's and the loss's."""

    def token_logprobs(self, logits: Tensor, tokens: Tensor) -> Tensor:
        shifted = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
        return super().token_logprobs(logits, shifted)


class StaleWeights(PPOLightningModule):
    """The rollout sampled with the weights from before the last update while ``ppo.max_staleness`` 0
    claims it is on-policy (a weight sync that lands one step late): no importance weights correct it,
    as the run believes the samples are its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._previous: dict[str, Tensor] | None = None

    def generate(self, batch: PromptBatch) -> Rollout:
        current = {name: value.detach().clone() for name, value in self.policy.state_dict().items()}
        if self._previous is not None:
            self.policy.load_state_dict(self._previous)
        try:
            return super().generate(batch)
        finally:
            self.policy.load_state_dict(current)
            self._previous = current


class WhitenedPerRank(PPOLightningModule):
    """Advantages whitened over each rank's own tokens instead of every rank's (the mean and variance
    not all-reduced): each rank's advantages get their own scale."""

    def experience(
        self, rollout: Rollout, forwards: RolloutForwards, scores: Tensor, kl_coef: float
    ) -> Experience:
        logprobs, ref_logprobs, values = forwards.logprobs, forwards.ref_logprobs, forwards.values
        return make_experience(rollout, logprobs, ref_logprobs, values, scores, kl_coef, self.ppo)
