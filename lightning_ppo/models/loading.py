"""Building the trained and frozen roles from Hugging Face checkpoints (paths or hub names).

Every model is loaded with dropout off: PPO's first minibatch must reproduce the rollout's
log-probs exactly (ratio == 1), and dropout would make the policy and reference disagree at random.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lightning_ppo.distributed.sharded_loading import (
    build_skeleton,
    defer_child,
    defer_copy,
    deferring,
    is_skeleton,
)
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn

# Names of the dtypes that frozen weights may be loaded in (``frozen_dtype``).
FROZEN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# Activations with a fused PyTorch kernel computing the same formula. GPT-2-family configs
# ask for "gelu_new", which transformers runs as six separate tensor ops; PyTorch's tanh GELU is
# the identical approximation in one kernel (outputs agree to float rounding, ~1e-7), 4-10 %
# off a GPT-2 forward + backward on CPU.
FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh"}


def load_config(name_or_path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """A checkpoint's config with dropout off and fused kernels for its activation."""
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # Architectures name their dropout rates differently (attn_pdrop, attention_dropout, ...);
    # some apply them functionally, so zeroing the nn.Dropout modules alone is not enough.
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    activation = getattr(config, "activation_function", None)
    if activation in FUSED_ACTIVATIONS:
        config.activation_function = FUSED_ACTIVATIONS[activation]
    return config


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` in ``model`` to p=0 (for models built without our loaders)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Frozen roles never receive gradients and always run in eval mode."""
    model.requires_grad_(False)
    return model.eval()


def load_pretrained(
    auto_class: Any,
    name_or_path: str,
    config: PretrainedConfig,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    deferrable: bool = True,
) -> tuple[PreTrainedModel, list[str]]:
    """``auto_class.from_pretrained`` and the parameters its checkpoint lacked (transformers initialises
    them at random). Inside ``deferred_loading()`` (``PPOLightningModule.__init__``) a skeleton
    instead, whose weights are read on the device it runs on (each rank its shards under FSDP2:
    lightning_ppo.distributed.sharded_loading), unless ``deferrable`` is off or the checkpoint is not plain
    safetensors holding every parameter: then whole, as without it.

    ``dtype`` None means fp32, not the checkpoint's own: transformers 5 loads a checkpoint in the
    dtype it was saved in, and hub models are saved in bf16, so a policy would train in bf16
    weights and AdamW state (under bf16-mixed too, which wants fp32 master weights), where an
    update of lr 1e-6 is below bf16's resolution and rounds away; and a frozen reference in bf16
    beside an fp32 policy would start the KL above 0. ``frozen_dtype`` lowers the frozen roles.
    """
    dtype = dtype or torch.float32
    if deferrable and deferring():
        skeleton = build_skeleton(auto_class, name_or_path, config, trust_remote_code, dtype)
        if skeleton is not None and not skeleton.missing:
            return skeleton.model, []
    model, loading = auto_class.from_pretrained(
        name_or_path,
        config=config,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        output_loading_info=True,
    )
    return model, loading["missing_keys"]


def load_causal_lm(
    name_or_path: str,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    deferrable: bool = True,
) -> PreTrainedModel:
    """A causal LM (policy or reference) with dropout off."""
    config = load_config(name_or_path, trust_remote_code)
    model, _ = load_pretrained(
        AutoModelForCausalLM, name_or_path, config, trust_remote_code, dtype, deferrable
    )
    return disable_dropout(model)


def classifier_head(model: PreTrainedModel) -> nn.Module:
    """The output layer of a ``*ForSequenceClassification`` model (``score`` or ``classifier``)."""
    return model.score if hasattr(model, "score") else model.classifier


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: one value per position.

    The head starts at zero so the first value estimates are 0, not noise, and the critic's
    early error cannot dominate the advantages.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.v_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    @classmethod
    def from_pretrained(cls, name_or_path: str, trust_remote_code: bool = False) -> ValueModel:
        """The backbone of any HF checkpoint plus a value head.

        From a one-output sequence classifier (a reward model, as InstructGPT and TRL initialise the
        critic) the head starts as the classifier's score head; otherwise at zero.
        """
        config = load_config(name_or_path, trust_remote_code)
        archs = config.architectures or []
        if any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels == 1:
            classifier, _ = load_pretrained(
                AutoModelForSequenceClassification, name_or_path, config, trust_remote_code
            )
            return cls._from_classifier(classifier)
        backbone, _ = load_pretrained(AutoModel, name_or_path, config, trust_remote_code)
        return cls(disable_dropout(backbone))

    @classmethod
    def _from_classifier(cls, classifier: PreTrainedModel) -> ValueModel:
        """The classifier's backbone, and its score head as the value head."""
        prefix, head = classifier.base_model_prefix, classifier_head(classifier)
        if is_skeleton(classifier):  # FSDP2: both are read from the checkpoint with the shards
            value_model = cls(disable_dropout(defer_child(classifier, prefix)))
            head_name = "score" if hasattr(classifier, "score") else "classifier"
            taken = ["weight"] + ["bias"] * (head.bias is not None)
            defer_copy(value_model, classifier, {f"v_head.{n}": f"{head_name}.{n}" for n in taken})
            return value_model
        value_model = cls(disable_dropout(getattr(classifier, prefix)))
        with torch.no_grad():
            value_model.v_head.weight.copy_(head.weight)
            if head.bias is not None:
                value_model.v_head.bias.copy_(head.bias)
        return value_model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """(B, L) value of the state at each position."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        # A new tensor, not a view of the head's output (``.float()`` of fp32 is a no-op): torch warns
        # that a view returned through FSDP2's output hooks "can produce wrong gradients".
        return self.v_head(hidden).squeeze(-1).to(torch.float32, copy=True)


def response_logits(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, length: int
) -> Tensor:
    """(B, length, V) logits predicting the last ``length`` tokens of each sequence.

    ``logits_to_keep`` runs the LM head on those positions only: the prompt's logits are never needed.
    """
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=length + 1,
    ).logits
    return logits[:, :-1]


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, with EOS standing in for a missing pad token."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError(f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token")
        # Safe: masks come from lengths and the stop token, never from comparing ids with the pad id.
        tokenizer.pad_token = tokenizer.eos_token
        warn(f"tokenizer {name_or_path!r} has no pad token: using its EOS token {tokenizer.eos_token!r}")
    return tokenizer


def resolve_stop_token(tokenizer: PreTrainedTokenizerBase, stop_token: str | None) -> int:
    """The id of ``generation.stop_token`` (EOS when unset), checked against the vocabulary."""
    if stop_token is None:
        if tokenizer.eos_token_id is None:
            raise UsageError("generation.stop_token is unset and the tokenizer has no EOS token: set one")
        return tokenizer.eos_token_id
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    if token_id is None or token_id == tokenizer.unk_token_id and stop_token != tokenizer.unk_token:
        raise UsageError(
            f"generation.stop_token {stop_token!r} is not a single token of the tokenizer's vocabulary"
        )
    return token_id


def resolve_suppressed_tokens(
    tokenizer: PreTrainedTokenizerBase, tokens: list[str | int], stop_token: str | None = None
) -> list[int]:
    """Ids of ``generation.suppress_tokens``: ids as given, token strings through the vocabulary, and
    patterns (``*`` / ``?`` wildcards, see :func:`token_pattern`) to every token they match.

    The stop token (``generation.stop_token``, None: EOS) is refused: suppressed, no response could end.
    """
    try:
        stop_id = resolve_stop_token(tokenizer, stop_token) if tokens else None
    except UsageError:  # no stop token to resolve: the module says so itself, in its own words
        stop_id = None
    ids: set[int] = set()
    for token in tokens:
        matched = _suppressed_ids(tokenizer, token)
        if stop_id in matched:
            _refuse_stop_token(tokenizer, token, stop_id, stop_token)
        ids.update(matched)
    if len(ids) >= len(tokenizer):  # nothing left to sample: generate would fail on NaN probabilities
        raise UsageError(f"generation.suppress_tokens {tokens!r} suppresses every token of the vocabulary")
    return sorted(ids)


def _suppressed_ids(tokenizer: PreTrainedTokenizerBase, token: str | int) -> list[int]:
    if isinstance(token, int):
        if not 0 <= token < len(tokenizer):
            raise UsageError(
                f"generation.suppress_tokens: id {token} is outside the tokenizer's {len(tokenizer)} tokens"
            )
        return [token]
    token_id = tokenizer.convert_tokens_to_ids(token)
    # A token of the vocabulary is itself even if it holds a wildcard ("?", "**"): lists that worked
    # before patterns keep their meaning.
    if token_id is not None and (token_id != tokenizer.unk_token_id or token == tokenizer.unk_token):
        return [token_id]
    pattern = token_pattern(token)
    if pattern is None:
        raise UsageError(
            f"generation.suppress_tokens: {token!r} is not a single token of the tokenizer's vocabulary"
        )
    matched = [token_id for text, token_id in tokenizer.get_vocab().items() if pattern.fullmatch(text)]
    if not matched:
        raise UsageError(
            f"generation.suppress_tokens: pattern {token!r} matches no token of the tokenizer's vocabulary"
        )
    return matched


def token_pattern(token: str) -> re.Pattern[str] | None:
    """The regex of a ``suppress_tokens`` pattern, or None for a plain token string.

    ``*`` stands for any run of characters and ``?`` for one; every other character is itself. Not
    ``fnmatch``: its ``[...]`` is a character class, and ``[unused*]`` must match ``[unused0]``,
    not ``u`` or ``n``.
    """
    if "*" not in token and "?" not in token:
        return None
    wildcards = {"*": ".*", "?": "."}
    return re.compile("".join(wildcards.get(char) or re.escape(char) for char in token), re.DOTALL)


def _refuse_stop_token(
    tokenizer: PreTrainedTokenizerBase, token: str | int, stop_id: int, stop_token: str | None
) -> None:
    is_pattern = isinstance(token, str) and token_pattern(token) is not None
    eos = f"null: the tokenizer's EOS {tokenizer.convert_ids_to_tokens(stop_id)!r}"
    stop = (
        f"generation.stop_token {stop_token!r}" if stop_token is not None else f"generation.stop_token {eos}"
    )
    raise UsageError(
        f"generation.suppress_tokens: {token!r} {'matches' if is_pattern else 'is'} the stop token ({stop}, "
        f"id {stop_id}): suppressed, "
        "no response could ever end; remove it from generation.suppress_tokens or set another "
        "generation.stop_token"
    )
