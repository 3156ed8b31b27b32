"""lightning_ppo: PPO for RLHF of causal language models, as a PyTorch Lightning package."""

from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.data import PromptBatch, PromptDataModule
from lightning_ppo.experience import Experience, make_experience
from lightning_ppo.module import PPOLightningModule
from lightning_ppo.rewards import RewardFunction, ScoreInputs
from lightning_ppo.rollout import Rollout

__all__ = [
    "Experience",
    "GenerationConfig",
    "PPOConfig",
    "PPOLightningModule",
    "PromptBatch",
    "PromptDataModule",
    "RewardFunction",
    "Rollout",
    "ScoreInputs",
    "make_experience",
]
__version__ = "0.1.0"
