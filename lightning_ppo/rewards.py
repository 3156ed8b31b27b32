"""Where scores come from: Python reward functions on text, or a reward-model checkpoint.

A score is one number per sequence. Whatever computes it, ``check_scores`` turns it into a
float tensor of shape (B,) or raises an error that names the reward and what was wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from lightning_ppo.models import _config_without_dropout, freeze
from lightning_ppo.rollout import Rollout


@dataclass
class ScoreInputs:
    """What a reward sees besides the text: dataset columns and the token ids of the rollout.

    Args:
        extras: Every dataset column other than the prompt, one value per sample (e.g. an answer).
        rollout: The prompt and response token ids and masks.
    """

    extras: dict[str, list[Any]] = field(default_factory=dict)
    rollout: Rollout | None = None


class RewardFunction(ABC):
    """A reward computed from text. Subclass it and select it in YAML by ``class_path``.

    ``__call__`` returns one number per completion (a list, or a tensor of shape (B,)).
    """

    @property
    def name(self) -> str:
        """The name the reward is logged under."""
        return type(self).__name__

    @abstractmethod
    def __call__(
        self, prompts: list[str], completions: list[str], batch: ScoreInputs
    ) -> Tensor | Sequence[float]:
        """Score each completion of its prompt."""


def check_scores(scores: Any, batch_size: int, name: str, device: torch.device | None = None) -> Tensor:
    """Validate a reward's output and return it as a float32 tensor of shape (batch_size,)."""
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"reward {name!r} must return numbers (a list or a tensor), got {type(scores).__name__}"
        ) from err
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor.squeeze(1)
    if tensor.shape != (batch_size,):
        raise ValueError(
            f"reward {name!r} must return one score per completion, shape ({batch_size},), "
            f"got shape {tuple(tensor.shape)}"
        )
    if not torch.isfinite(tensor).all():
        bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()
        raise ValueError(f"reward {name!r} returned NaN or inf at positions {bad[:10]}")
    return tensor


class RewardModel(nn.Module):
    """A frozen ``AutoModelForSequenceClassification`` (num_labels=1) scoring token ids directly.

    The score is read at the last real token of each sequence, located from the attention mask,
    not from ``pad_token_id`` as HF's own pooling does (which breaks when pad == eos).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = freeze(model)

    @classmethod
    def from_pretrained(cls, name_or_path: str, trust_remote_code: bool = False) -> RewardModel:
        config = _config_without_dropout(name_or_path, trust_remote_code)
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, config=config, trust_remote_code=trust_remote_code
        )
        return cls(model)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """(B,) score at the last real token of each right-padded-by-response sequence."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        head = self.model.score if hasattr(self.model, "score") else self.model.classifier
        last = attention_mask.shape[1] - 1 - attention_mask.long().flip(1).argmax(1)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return head(hidden[rows, last]).squeeze(-1).float()
