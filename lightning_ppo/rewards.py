"""Where scores come from: Python reward functions on text, or a reward-model checkpoint.

A score is one number per sequence. Whatever computes it, ``check_scores`` turns it into a
float tensor of shape (B,) or raises an error that names the reward and what was wrong.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from lightning_ppo.distributed.sharding import as_many_on_every_rank, is_sharded
from lightning_ppo.models.loading import (
    FROZEN_DTYPES,
    classifier_head,
    freeze,
    load_config,
    load_pretrained,
    load_tokenizer,
)
from lightning_ppo.ppo.functional import Reduce, masked_mean, masked_var
from lightning_ppo.ppo.rollout_data import Rollout, position_ids_from_mask
from lightning_ppo.ppo.row_groups import forward_groups
from lightning_ppo.runs.errors import MissingPathError, UsageError, UsageTypeError
from lightning_ppo.runs.preflight import _looks_local, no_head_message


@dataclass
class TrainerState:
    """What a reward asking for ``trainer_state`` gets: the fields of TRL's ``TrainerState`` that mean
    something here, counted in PPO iterations (one rollout batch and its update), not optimizer steps.

    Args:
        global_step: PPO iterations done before this batch.
        max_steps: Iterations the run will make (``trainer.max_steps`` in iterations, or ``max_epochs``
            x batches per epoch, whichever ends it first); -1 when unknown (outside a Trainer).
        epoch: Epochs done, with the fraction of the current one.
        num_train_epochs: ``trainer.max_epochs``; -1 when unbounded or unknown.
        is_world_process_zero: Whether this is rank 0 of the job.
        is_local_process_zero: Whether this is rank 0 of its machine.
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: float = 0.0
    num_train_epochs: int = -1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


# The log_extra column of per-completion correctness (1.0 / 0.0) that validation logs as eval/accuracy.
ACCURACY_COLUMN = "correct"


def _discard(*args: Any) -> None:
    """``log_metric`` and ``log_extra`` outside a module's ``score``: nothing to log to."""


@dataclass
class ScoreInputs:
    """What a reward sees besides the text: dataset columns, the token ids of the rollout, and TRL's
    extras (``trainer_state``, ``log_metric``, ``log_extra``), which TRL-style rewards get as keywords.

    Args:
        extras: Every dataset column other than the prompt, one value per sample (e.g. an answer).
        rollout: The prompt and response token ids and masks.
        messages: Conversational data's prompts as lists of ``{"role", "content"}`` messages (before
            the chat template, whole even when the tokens were cut); ``None`` for text prompts.
        trainer_state: The run's progress.
        log_metric: ``log_metric(name, value)`` logs a number as ``reward/<name>`` (the mean of the
            values given for one batch).
        log_extra: ``log_extra(column, values)`` adds a column, one value per completion, to the sample
            tables (``lightning_ppo.callbacks.SampleTable``). A reward that knows right from wrong
            writes 1.0 / 0.0 as ``ACCURACY_COLUMN`` (``correct``): logged as ``reward/accuracy``, and
            as ``eval/accuracy`` in validation (``lightning_ppo.MathAnswerReward`` does).
    """

    extras: dict[str, list[Any]] = field(default_factory=dict)
    rollout: Rollout | None = None
    messages: list[list[dict[str, Any]]] | None = None
    trainer_state: TrainerState = field(default_factory=TrainerState)
    log_metric: Callable[[str, float], None] = _discard
    log_extra: Callable[[str, list], None] = _discard


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
# signature (a plain function by its import path, or a class with __call__ by class_path), or, as
# TRL takes them, a reward model: its path (a string) or, in Python, a loaded PreTrainedModel.
RewardLike = RewardFunction | Callable[..., Any] | str


def is_reward_model(reward: Any) -> bool:
    """Whether a ``reward_fn`` entry is a reward model: a path or hub name, or a loaded model."""
    return isinstance(reward, (str, PreTrainedModel))


def reward_name(reward: Any) -> str:
    """The name a reward is logged under: ``name``, a function's ``__name__`` (a ``functools.partial``'s
    with its arguments: ``score_scale=2``), a reward model's folder name, or the class name."""
    if isinstance(reward, RewardFunction):
        return reward.name
    if isinstance(reward, functools.partial):
        keywords = [f"{k}={_short(v)}" for k, v in reward.keywords.items()]
        return "_".join([reward_name(reward.func), *map(_short, reward.args), *keywords])
    if isinstance(reward, PreTrainedModel):
        reward = getattr(reward.config, "_name_or_path", "") or type(reward).__name__
    if isinstance(reward, str):
        return os.path.basename(reward.rstrip("/\\")) or reward
    return getattr(reward, "__name__", type(reward).__name__)


def _short(value: Any) -> str:
    """An argument of a partial in a name: scalars as written, anything else by its type."""
    return str(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__


OUR_CONVENTION = "fn(prompts, completions, batch) with batch a lightning_ppo.rewards.ScoreInputs"
TRL_CONVENTION = (
    "TRL's fn(prompts, completions, **kwargs), given completion_ids and every dataset column as keywords"
)
# What TRL passes besides the dataset's columns (and wins over a column of the same name).
_TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass
class RewardCall:
    """A reward and the convention it is called with, decided once from its signature.

    Ours: ``fn(prompts, completions, batch)``. TRL's reward functions:
    ``fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
    log_metric=..., **columns)``, where ``completion_ids`` are each response's token ids up to and
    including the stop token (no padding) and every other dataset column arrives as a keyword
    argument of its own name; with conversational data ``prompts`` are the message lists and each
    completion is ``[{"role": "assistant", "content": text}]``, as TRL passes them. Either may be a
    coroutine function (the caller awaits what it returns). A reward model in the list (a path or a
    loaded ``PreTrainedModel``) scores through :attr:`model`, set by :func:`load_reward_models`.
    """

    fn: RewardLike
    trl: bool
    name: str = ""
    model: RewardModel | None = None

    @classmethod
    def of(cls, fn: RewardLike) -> RewardCall:
        """Inspect ``fn``'s signature; a signature that fits neither convention is a ``TypeError``."""
        if is_reward_model(fn):
            return cls(fn, False, reward_name(fn))
        trl = uses_trl_convention(fn)
        if trl is None:
            name = reward_name(fn)
            raise UsageTypeError(
                f"model.reward_fn {name!r} has the signature {name}{inspect.signature(fn)}, which fits "
                f"neither way a reward is called: {OUR_CONVENTION}, or {TRL_CONVENTION}"
            )
        return cls(fn, trl, reward_name(fn))

    @property
    def is_model(self) -> bool:
        return is_reward_model(self.fn)

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Any:
        if self.is_model:
            if self.model is None:
                raise RuntimeError(f"reward model {self.name!r} is not loaded: call load_reward_models first")
            return self.model.score(prompts, completions, batch.rollout, batch.messages)
        if not self.trl:
            return self.fn(prompts, completions, batch)
        trl_prompts: list[Any] = prompts
        trl_completions: list[Any] = completions
        if batch.messages is not None:  # conversational data: TRL's shapes
            trl_prompts = batch.messages
            trl_completions = [[{"role": "assistant", "content": c}] for c in completions]
        kwargs = {
            **batch.extras,
            "prompts": trl_prompts,
            "completions": trl_completions,
            "trainer_state": batch.trainer_state,
            "log_extra": batch.log_extra,
            "log_metric": batch.log_metric,
        }
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

    A ``**kwargs`` parameter and no parameter named ``batch`` (TRL's ``f(prompts, completions,
    answer, **kwargs)``, or a catch-all ``f(*args, **kwargs)``) means TRL's, unless a positional-only
    parameter rules keywords out; otherwise a callable that takes three positional arguments is ours.
    """
    Kind = inspect.Parameter
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False  # no inspectable signature (a builtin or C extension): call it our way
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    if Kind.VAR_KEYWORD in kinds and Kind.POSITIONAL_ONLY not in kinds:
        if "batch" not in signature.parameters:
            return True
    try:
        signature.bind(None, None, None)
    except TypeError:
        return None
    return False


def reward_calls(entries: Sequence[Any]) -> list[RewardCall]:
    """The ``reward_fn`` entries as :class:`RewardCall` s, each with a name of its own.

    A string is a reward model's folder (or hub name), else an import path (``pkg.module.fn``); a
    loaded ``PreTrainedModel`` is a reward model too. Names that would repeat get ``_2``, ``_3``...
    """
    calls = []
    for entry in entries:
        if isinstance(entry, str):
            entry = _resolve(entry)
        if not callable(entry) and not is_reward_model(entry):
            raise TypeError(
                "model.reward_fn entries must be callable, a reward model's path or a loaded "
                f"PreTrainedModel, got {type(entry).__name__}"
            )
        calls.append(RewardCall.of(entry))
    seen: Counter[str] = Counter()
    for call in calls:
        seen[call.name] += 1
        if seen[call.name] > 1:
            call.name = f"{call.name}_{seen[call.name]}"
    return calls


def _resolve(text: str) -> Any:
    """A string ``reward_fn`` entry: a reward model's folder or hub name as it is, or the function an
    import path names."""
    if os.path.isdir(os.path.expanduser(text)):
        return text
    if "." in text and not any(sep in text for sep in "/\\"):
        module, _, attribute = text.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise UsageError(
                f"model.reward_fn {text!r} is neither a reward model's folder nor an importable function "
                f"({err})"
            ) from err
    if os.path.isfile(os.path.expanduser(text)):
        raise UsageError(
            f"model.reward_fn {text!r} is a file; expected a reward model's folder or an import path"
        )
    if _looks_local(text):
        raise MissingPathError(f"model.reward_fn {text!r}: no such reward model folder")
    return text  # a hub name


def load_reward_models(
    calls: Sequence[RewardCall],
    policy_tokenizer: PreTrainedTokenizerBase | None,
    trust_remote_code: bool = False,
    dtype: str | None = None,
) -> list[RewardModel]:
    """Load the reward models among ``calls`` (a path as ``model.reward_model`` loads one, a loaded
    model wrapped as it is) and return them in list order, to be registered as submodules (each a
    child of its own: FSDP2 shards every child of the module as a unit with its own forward)."""
    for call in calls:
        if call.is_model and call.model is None:
            if isinstance(call.fn, str):
                call.model = RewardModel.from_pretrained(
                    call.fn, policy_tokenizer, None, trust_remote_code, dtype=dtype
                )
            else:
                call.model = RewardModel.from_model(call.fn, policy_tokenizer, trust_remote_code)
    return [call.model for call in calls if call.model is not None]


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

    Detached: a ``torch.nn`` scorer called without ``no_grad`` returns its graph, which ``as_tensor``
    keeps; the advantages would carry it, the first backward would reach the reward's parameters and
    the second minibatch's would fail on the freed graph.
    """
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float32, device=device).detach()
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
                "model.reward_chat_template is set but the reward model's tokenizer has no chat template"
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
        model, missing_keys = load_pretrained(
            AutoModelForSequenceClassification,
            name_or_path,
            config,
            trust_remote_code,
            FROZEN_DTYPES.get(dtype),
        )
        head = "score" if hasattr(model, "score") else "classifier"  # as classifier_head() reads it
        missing = sorted(key for key in missing_keys if key.split(".")[0] == head)
        if missing:  # transformers initialised the head at random: every score would be noise
            raise UsageError(no_head_message(name_or_path, f"{', '.join(missing)} missing"))
        own = _own_tokenizer(name_or_path, policy_tokenizer, tokenizer, trust_remote_code, chat_template)
        return cls(model, own, chat_template)

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        policy_tokenizer: PreTrainedTokenizerBase | None = None,
        trust_remote_code: bool = False,
    ) -> RewardModel:
        """A loaded sequence classifier with one label; its tokenizer from the folder it was loaded from
        (``config._name_or_path``) when there is one there, else the policy's."""
        name = reward_name(model)
        if getattr(model.config, "num_labels", None) != 1:
            raise UsageError(f"reward model {name!r} has {model.config.num_labels} labels; a reward needs 1")
        source = getattr(model.config, "_name_or_path", "")
        own = _own_tokenizer(source, policy_tokenizer, None, trust_remote_code, False) if source else None
        return cls(model, own)

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        rollout: Rollout,
        messages: list[list[dict[str, Any]]] | None = None,
    ) -> Tensor:
        """(B,) scores of the rollout's sequences. With conversational data (``messages``) and a
        tokenizer of its own that has a chat template, the conversation and the completion as the
        assistant's reply in that template, as TRL scores them."""
        if self.tokenizer is None:
            return self(rollout.input_ids, rollout.attention_mask, rollout.position_ids)
        if messages is not None and getattr(self.tokenizer, "chat_template", None):
            texts = [
                self.tokenizer.apply_chat_template([*m, {"role": "assistant", "content": c}], tokenize=False)
                for m, c in zip(messages, completions, strict=True)
            ]
            return self(*retokenize(texts, [""] * len(texts), self.tokenizer, rollout.input_ids.device))
        if self.chat_template:
            prompts, completions = as_chat(prompts, completions, self.tokenizer), [""] * len(completions)
        return self(*retokenize(prompts, completions, self.tokenizer, rollout.input_ids.device))

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """(B,) score at the last real token of each sequence (any padding side), computed for groups
        of similar-length rows without the columns that are padding in all of a group's rows."""
        backbone, head = getattr(self.model, self.model.base_model_prefix), classifier_head(self.model)
        scores = torch.zeros(len(input_ids), device=input_ids.device)
        groups = forward_groups(attention_mask.bool(), 0)
        groups = as_many_on_every_rank(groups, 0, input_ids.device, is_sharded(self.model))
        for group in groups:
            rows, cols = group.rows.to(input_ids.device), group.columns(0)
            mask = attention_mask[rows, cols]
            hidden = backbone(
                input_ids=input_ids[rows, cols], attention_mask=mask, position_ids=position_ids[rows, cols]
            )
            if not group.idle:
                scores[rows] = head(at_last_real_token(hidden.last_hidden_state, mask)).squeeze(-1).float()
        return scores


def _own_tokenizer(
    name_or_path: str,
    policy_tokenizer: PreTrainedTokenizerBase | None,
    tokenizer: str | None,
    trust_remote_code: bool,
    chat_template: bool,
) -> PreTrainedTokenizerBase | None:
    """A reward model's tokenizer, or ``None`` when it reads the policy's token ids directly."""
    try:
        own = load_tokenizer(tokenizer or name_or_path, trust_remote_code)
    except (OSError, ValueError):
        if tokenizer is not None:
            raise
        return None  # a checkpoint saved without a tokenizer was trained on the policy's
    shares_vocab = policy_tokenizer is not None and own.get_vocab() == policy_tokenizer.get_vocab()
    if shares_vocab and not chat_template:
        return None  # score the rollout's token ids directly, no text round trip
    return own


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
            raise UsageError(
                f"model.reward_adapter {path!r} has no score head (train it with task_type='SEQ_CLS')"
            )
        head = weights[heads[0]]
        if head.shape[0] != 1:
            raise UsageError(f"model.reward_adapter {path!r} has {head.shape[0]} labels; a reward needs 1")
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
