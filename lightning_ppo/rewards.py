"""Where scores come from: Python reward functions on text, or a reward-model checkpoint.

A score is one number per sequence. Whatever computes it, ``check_scores`` turns it into a
float tensor of shape (B,) or raises an error that names the reward and what was wrong.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from lightning_ppo.errors import UsageError, UsageTypeError
from lightning_ppo.functional import Reduce, masked_mean, masked_var
from lightning_ppo.models import FROZEN_DTYPES, classifier_head, freeze, load_config, load_tokenizer
from lightning_ppo.rollout import Rollout, position_ids_from_mask


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


# A reward selected in YAML: a RewardFunction subclass by class_path, or any callable with the same
# signature (a plain function by its import path, or a class with __call__ by class_path).
RewardLike = RewardFunction | Callable[..., Any]


def reward_name(reward: RewardLike) -> str:
    """The name a reward is logged under: ``name``, a function's ``__name__``, or the class name."""
    if isinstance(reward, RewardFunction):
        return reward.name
    return getattr(reward, "__name__", type(reward).__name__)


OUR_CONVENTION = "fn(prompts, completions, batch) with batch a lightning_ppo.rewards.ScoreInputs"
TRL_CONVENTION = (
    "TRL's fn(prompts, completions, **kwargs), given completion_ids and every dataset column as keywords"
)
_TRL_KEYWORDS = ("prompts", "completions", "completion_ids")


@dataclass
class RewardCall:
    """A reward on text and the convention it is called with, decided once from its signature.

    Ours: ``fn(prompts, completions, batch)``. TRL's reward functions:
    ``fn(prompts=..., completions=..., completion_ids=..., **columns)``, where ``completion_ids``
    are each response's token ids up to and including the stop token (no padding) and every other
    dataset column arrives as a keyword argument of its own name.
    """

    fn: RewardLike
    trl: bool

    @classmethod
    def of(cls, fn: RewardLike) -> RewardCall:
        """Inspect ``fn``'s signature; a signature that fits neither convention is a ``TypeError``."""
        trl = uses_trl_convention(fn)
        if trl is None:
            name = reward_name(fn)
            raise UsageTypeError(
                f"reward_fn {name!r} has the signature {name}{inspect.signature(fn)}, which fits neither "
                f"way a reward is called: {OUR_CONVENTION}, or {TRL_CONVENTION}"
            )
        return cls(fn, trl)

    @property
    def name(self) -> str:
        return reward_name(self.fn)

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Any:
        if not self.trl:
            return self.fn(prompts, completions, batch)
        # The three names TRL passes win over dataset columns of the same name.
        kwargs = {**batch.extras, "prompts": prompts, "completions": completions}
        if batch.rollout is not None:
            kwargs["completion_ids"] = completion_ids(batch.rollout)
        self._check_columns(kwargs)
        return self.fn(**kwargs)

    def _check_columns(self, kwargs: dict[str, Any]) -> None:
        """A TRL reward asking for a column the dataset lacks: say which columns there are."""
        required = [
            p.name
            for p in inspect.signature(self.fn).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        missing = [name for name in required if name not in kwargs]
        if missing:
            columns = sorted(set(kwargs) - set(_TRL_KEYWORDS))
            raise UsageTypeError(
                f"reward {self.name!r} needs the dataset column(s) {missing}; the batch has {columns}"
            )


def uses_trl_convention(fn: RewardLike) -> bool | None:
    """``True``: TRL's keyword convention; ``False``: ours; ``None``: neither fits.

    A ``**kwargs`` parameter and no third positional parameter (or one not named ``batch``, as in
    TRL's ``f(prompts, completions, answer, **kwargs)``) means TRL's; otherwise a callable that takes
    three positional arguments is ours.
    """
    Kind = inspect.Parameter
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False  # no inspectable signature (a builtin or C extension): call it our way
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    named = [p for p in params if p.kind in (Kind.POSITIONAL_ONLY, Kind.POSITIONAL_OR_KEYWORD)]
    third = named[2] if len(named) > 2 else None
    takes_third = third is not None or Kind.VAR_POSITIONAL in kinds
    if Kind.VAR_KEYWORD in kinds and Kind.POSITIONAL_ONLY not in kinds:
        if not takes_third or (third is not None and third.name != "batch"):
            return True
    try:
        signature.bind(None, None, None)
    except TypeError:
        return None
    return False


def completion_ids(rollout: Rollout) -> list[list[int]]:
    """Each response's token ids up to and including its stop token, without padding (a multi-turn
    episode's: every turn and observation)."""
    return rollout.episode_token_ids()


def check_scores(
    scores: Any, batch_size: int, name: str, device: torch.device | None = None, allow_nonfinite: bool = False
) -> Tensor:
    """Validate a reward's output and return it as a float32 tensor of shape (batch_size,).

    NaN and inf raise unless ``allow_nonfinite`` (the caller then drops those samples). Every error
    here is the reward's, so a usage error: the command reports it in one line.
    """
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UsageTypeError(
            f"reward {name!r} must return numbers (a list or a tensor), got {type(scores).__name__}"
        ) from err
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor.squeeze(1)
    if tensor.shape != (batch_size,):
        raise UsageError(
            f"reward {name!r} must return one score per completion, shape ({batch_size},), "
            f"got shape {tuple(tensor.shape)}"
        )
    if not allow_nonfinite and not torch.isfinite(tensor).all():
        bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()
        raise UsageError(
            f"reward {name!r} returned NaN or inf at positions {bad[:10]} (ppo.on_bad_reward: drop leaves "
            "such samples out of the update)"
        )
    return tensor


class RewardModel(nn.Module):
    """A frozen ``AutoModelForSequenceClassification`` (num_labels=1) and its tokenizer.

    The score is read at the last real token of each sequence, located from the attention mask,
    not from ``pad_token_id`` as HF's own pooling does (which breaks when pad == eos). A reward
    model with the policy's vocabulary scores the rollout's token ids directly; one with another
    tokenizer gets the decoded prompt + completion text, re-tokenised with its own tokenizer.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: bool = False,
    ) -> None:
        super().__init__()
        self.model = freeze(model)
        self.tokenizer = tokenizer  # None: the policy's tokenizer, no text round trip
        self.chat_template = chat_template
        if chat_template and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
            raise UsageError(
                "reward_chat_template is set but the reward model's tokenizer has no chat template"
            )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        policy_tokenizer: PreTrainedTokenizerBase | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        chat_template: bool = False,
        dtype: str | None = None,
    ) -> RewardModel:
        """Load the classifier; its tokenizer from ``tokenizer``, the checkpoint, or else the policy's."""
        config = load_config(name_or_path, trust_remote_code)
        config.num_labels = 1
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            name_or_path,
            config=config,
            trust_remote_code=trust_remote_code,
            dtype=FROZEN_DTYPES.get(dtype),
            output_loading_info=True,
        )
        head = "score" if hasattr(model, "score") else "classifier"  # as classifier_head() reads it
        missing = sorted(key for key in loading["missing_keys"] if key.split(".")[0] == head)
        if missing:  # transformers initialised the head at random: every score would be noise
            raise UsageError(no_head_message(name_or_path, f"{', '.join(missing)} missing"))
        try:
            own = load_tokenizer(tokenizer or name_or_path, trust_remote_code)
        except (OSError, ValueError):
            if tokenizer is not None:
                raise
            own = None  # a checkpoint saved without a tokenizer was trained on the policy's
        shares_vocab = (
            own is not None
            and policy_tokenizer is not None
            and own.get_vocab() == policy_tokenizer.get_vocab()
        )
        if shares_vocab and not chat_template:
            own = None  # score the rollout's token ids directly, no text round trip
        return cls(model, own, chat_template)

    def score(self, prompts: list[str], completions: list[str], rollout: Rollout) -> Tensor:
        """(B,) scores of the rollout's sequences."""
        if self.tokenizer is None:
            return self(rollout.input_ids, rollout.attention_mask, rollout.position_ids)
        if self.chat_template:
            prompts, completions = as_chat(prompts, completions, self.tokenizer), [""] * len(completions)
        return self(*retokenize(prompts, completions, self.tokenizer, rollout.input_ids.device))

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """(B,) score at the last real token of each sequence (any padding side)."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return classifier_head(self.model)(at_last_real_token(hidden, attention_mask)).squeeze(-1).float()


def no_head_message(source: str, detail: str) -> str:
    return (
        f"model.reward_model: {source!r} has no scoring head in its weights ({detail}; a causal "
        "LM?): a reward model is a checkpoint of AutoModelForSequenceClassification with num_labels=1"
    )


def check_reward_head(source: str) -> None:
    """Fail, before loading, when a local reward-model folder's safetensors hold no scoring head.

    Loaded as a sequence classifier, such a checkpoint (e.g. a causal LM) gets a randomly initialised
    head, and the critic would start from it too. Heads are ``score`` or ``classifier`` (as
    :func:`~lightning_ppo.models.classifier_head` reads them); other formats are checked when loading.
    """
    folder = Path(source).expanduser()
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file():
        keys = set(json.loads(index.read_text())["weight_map"])
    elif single.is_file():
        with safe_open(single, "pt") as file:
            keys = set(file.keys())
    else:
        return
    if not any({"score", "classifier"} & set(key.split(".")) for key in keys):
        raise UsageError(no_head_message(source, "no score.* or classifier.* tensor"))


class RunningMoments:
    """Running mean and variance of every score seen so far (Chan et al.'s parallel update).

    Under several ranks :meth:`update` is given ``reduce`` and merges every rank's batch, so all
    ranks hold the same moments (and normalise, and checkpoint, the same).
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, values: Tensor, reduce: Reduce | None = None) -> None:
        """Merge a batch of scores (non-finite ones ignored); every rank calls it when ``reduce`` is set."""
        finite = torch.isfinite(values)
        values = values.double()
        batch_mean = masked_mean(values, finite, reduce=reduce)
        batch_var = masked_var(values, finite, unbiased=False, reduce=reduce)
        n = int(finite.sum() if reduce is None else reduce(finite.sum().double()))
        if n == 0:
            return
        batch_mean, batch_var = batch_mean.item(), batch_var.item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    def normalize(self, values: Tensor) -> Tensor:
        return (values - self.mean) / (self.var**0.5 + 1e-8)

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def retokenize(
    prompts: list[str], completions: list[str], tokenizer: PreTrainedTokenizerBase, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + completion text in a reward model's own tokenizer: (input_ids, attention_mask, position_ids).

    Right padding with a mask from the lengths; RewardModel reads the last real token from the mask.
    """
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt", padding_side="right")
    mask = encoded["attention_mask"].to(device).bool()
    return encoded["input_ids"].to(device), mask, position_ids_from_mask(mask)


def at_last_real_token(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, H) hidden state at each sequence's last real token, whichever side it is padded on."""
    last = attention_mask.shape[1] - 1 - attention_mask.long().flip(1).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def as_chat(prompts: list[str], completions: list[str], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each prompt and completion as a user/assistant conversation in ``tokenizer``'s chat template."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        for p, c in zip(prompts, completions, strict=True)
    ]


class AdapterReward(nn.Module):
    """A reward model that is a second LoRA adapter on the policy's own base (LoRA one-backbone).

    ``path`` is a PEFT adapter trained for sequence classification (``task_type="SEQ_CLS"``, one
    label) on the policy's base model. Its LoRA weights are loaded into the policy as the adapter
    ``reward`` and selected per forward (PEFT's ``adapter_names``), so the policy's own adapter
    stays the trained one; its score head is a small frozen ``Linear``. No second copy of the
    base weights is loaded.
    """

    ADAPTER = "reward"

    def __init__(self, policy: nn.Module, path: str) -> None:
        super().__init__()
        from safetensors.torch import load_file

        policy.load_adapter(path, adapter_name=self.ADAPTER, is_trainable=False)
        weights = load_file(f"{path}/adapter_model.safetensors")
        heads = [k for k in weights if k.endswith(("score.weight", "classifier.weight")) and "lora_" not in k]
        if not heads:
            raise UsageError(f"reward_adapter {path!r} has no score head (train it with task_type='SEQ_CLS')")
        head = weights[heads[0]]
        if head.shape[0] != 1:
            raise UsageError(f"reward_adapter {path!r} has {head.shape[0]} labels; a reward needs 1")
        self.score_head = nn.Linear(head.shape[1], 1, bias=False)
        with torch.no_grad():
            self.score_head.weight.copy_(head)
        self.score_head.requires_grad_(False)
        self._policy = [policy]  # a plain list: the policy must not be registered twice

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """(B,) score at the last real token, computed with the ``reward`` adapter active."""
        out = self._policy[0](
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            adapter_names=[self.ADAPTER] * input_ids.shape[0],
            output_hidden_states=True,
            logits_to_keep=1,
        )
        hidden = at_last_real_token(out.hidden_states[-1], attention_mask)
        return self.score_head(hidden.to(self.score_head.weight.dtype)).squeeze(-1).float()
