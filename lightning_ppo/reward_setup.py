"""A ``PPOLightningModule``'s rewards, from its arguments to what it keeps.

Built in three steps around the policy, in the module's ``__init__``: :meth:`RewardSetup.check`
before anything loads, so a reward with a wrong signature or a weight list of the wrong length fails
at construction, not mid-run; :meth:`RewardSetup.load_model` and :meth:`RewardSetup.load_listed`
inside ``building_roles`` (skeletons where they can be), before the roles, whose critic may start
from the reward model; :meth:`RewardSetup.load_adapter` after them, since a reward adapter is a second
LoRA adapter on the policy's own base.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.rewards import (
    AdapterReward,
    RewardCall,
    RewardLike,
    RewardModel,
    load_reward_models,
    reward_calls,
)
from lightning_ppo.runs.errors import UsageError


@dataclass
class RewardSetup:
    """The module's reward arguments, checked (the module keeps ``fns``, ``calls`` and ``weights``)."""

    fns: list[RewardLike]  # ``reward_fn`` as a list
    calls: list[RewardCall]  # how each of ``fns`` is called, decided once
    weights: list[float]  # one per reward: ``fns`` in order, then the reward model, then the adapter
    model: str | None  # ``reward_model``: a path
    adapter: str | None  # ``reward_adapter``: a path

    @classmethod
    def check(
        cls,
        reward_fn: RewardLike | list[RewardLike] | None,
        weights: list[float] | None,
        model: str | None,
        adapter: str | None,
        scored_otherwise: bool,
    ) -> RewardSetup:
        """The rewards as given, before any model loads. ``scored_otherwise``: an environment or tools
        reward the episodes, or a subclass overrides ``score``, so no configured reward is needed."""
        fns = [] if reward_fn is None else list(reward_fn) if isinstance(reward_fn, list) else [reward_fn]
        models = (model is not None) + (adapter is not None)
        count = len(fns) + models
        if count == 0 and not scored_otherwise:
            raise UsageError(
                "no reward: set model.reward_fn, model.reward_model, model.reward_adapter or "
                "model.environment, or override score() in a subclass"
            )
        # Decided once, here, before any model loads: a wrong signature fails now, not mid-run.
        calls = reward_calls(fns)
        if weights is not None and len(weights) != count:
            raise UsageError(
                f"model.reward_weights has {len(weights)} entries but there are {count} rewards "
                f"({len(fns)} model.reward_fn + {models} reward model or adapter)"
            )
        return cls(fns, calls, weights or [1.0] * count, model, adapter)

    def load_model(
        self,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_tokenizer: str | None,
        chat_template: bool,
        trust_remote_code: bool,
        frozen_dtype: str | None,
    ) -> RewardModel | None:
        """``model.reward_model``, loaded (``None`` without one)."""
        if not self.model:
            return None
        return RewardModel.from_pretrained(
            self.model, policy_tokenizer, reward_tokenizer, trust_remote_code, chat_template, frozen_dtype
        )

    def load_listed(
        self, policy_tokenizer: PreTrainedTokenizerBase, trust_remote_code: bool, frozen_dtype: str | None
    ) -> dict[str, nn.Module]:
        """The reward models in the ``reward_fn`` list, loaded into their calls, by the name the module
        registers each under: ``reward_fn_{i}``, by its place in the list. Children, as ``reward_model``
        is: moved, frozen and sharded with the module."""
        load_reward_models(self.calls, policy_tokenizer, trust_remote_code, frozen_dtype)
        return {f"reward_fn_{i}": call.model for i, call in enumerate(self.calls) if call.model is not None}

    def critic_source(self, policy: str, reward_model: RewardModel | None) -> str:
        """Where a separate critic starts: the reward model when it reads the policy's tokens
        (InstructGPT, TRL), else the policy."""
        if reward_model is not None and reward_model.tokenizer is None:
            return self.model  # type: ignore[return-value]  # loaded: it has a path
        return policy

    def load_adapter(
        self, policy: Callable[[], nn.Module], lora: LoraSettings | None
    ) -> AdapterReward | None:
        """``model.reward_adapter`` on the built policy's LoRA base (``None`` without one).

        ``policy`` is called only when there is an adapter: reaching the module's roles outside a
        Trainer reads every skeleton's weights onto the CPU (``models/placement.py``)."""
        if self.adapter is None:
            return None
        if lora is None:
            raise UsageError(
                "model.reward_adapter needs model.lora: it is a second adapter on the policy's LoRA base"
            )
        return AdapterReward(policy(), self.adapter)
