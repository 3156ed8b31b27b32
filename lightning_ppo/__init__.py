"""lightning_ppo: PPO for RLHF of causal language models, as a PyTorch Lightning package.

The names below are imported when first used, not with the package: ``lightning-ppo`` starts in
``lightning_ppo.console``, which must answer a Ctrl-C before torch, transformers and Lightning load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ppo import _moved

if TYPE_CHECKING:
    from lightning_ppo.config import GenerationConfig, PPOConfig
    from lightning_ppo.data import PromptBatch, PromptDataModule
    from lightning_ppo.module import PPOLightningModule
    from lightning_ppo.ppo.experience import Experience, make_experience
    from lightning_ppo.ppo.rollout_data import Rollout
    from lightning_ppo.rewards import RewardFunction, ScoreInputs
    from lightning_ppo.tasks.math_answer import MathAnswerReward, math_answer_reward

_HOMES = {
    "Experience": "lightning_ppo.ppo.experience",
    "GenerationConfig": "lightning_ppo.config",
    "MathAnswerReward": "lightning_ppo.tasks.math_answer",
    "PPOConfig": "lightning_ppo.config",
    "PPOLightningModule": "lightning_ppo.module",
    "PromptBatch": "lightning_ppo.data",
    "PromptDataModule": "lightning_ppo.data",
    "RewardFunction": "lightning_ppo.rewards",
    "Rollout": "lightning_ppo.ppo.rollout_data",
    "ScoreInputs": "lightning_ppo.rewards",
    "make_experience": "lightning_ppo.ppo.experience",
    "math_answer_reward": "lightning_ppo.tasks.math_answer",
}
__all__ = [
    "Experience",
    "GenerationConfig",
    "MathAnswerReward",
    "PPOConfig",
    "PPOLightningModule",
    "PromptBatch",
    "PromptDataModule",
    "RewardFunction",
    "Rollout",
    "ScoreInputs",
    "make_experience",
    "math_answer_reward",
]
__version__ = "0.1.0"

_moved.install()  # old module paths (``lightning_ppo.episodes``) import as their new homes


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lightning_ppo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
