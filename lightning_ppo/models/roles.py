"""The trained and frozen roles of a PPO run, and the forwards PPO needs from them.

Three layouts, chosen by ``value_model`` and ``lora``:

- separate: policy, frozen reference copy, and a critic with its own backbone (InstructGPT/TRL);
- shared: the critic is a scalar head on the policy's own backbone, so one forward gives both
  log-probs and values;
- LoRA: the policy trains adapters on a frozen base; the reference is the same base with the
  adapter disabled, so one copy of the base weights serves policy, reference (and a shared critic).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ppo.models.loading import FROZEN_DTYPES, ValueModel, freeze, load_causal_lm, response_logits
from lightning_ppo.runs.errors import UsageError

VALUE_MODEL_MODES = ("separate", "shared")
# Attention projections LoRA adapts by default, per architecture (model_type).
DEFAULT_LORA_TARGETS = {
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
}


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (PEFT).

    Args:
        r: Rank of the adapters.
        alpha: Scaling numerator (the update is scaled by alpha / r).
        dropout: Dropout on the adapter input. Keep 0: any dropout breaks ratio == 1 at the first
            minibatch of PPO.
        target_modules: Module names to adapt; default by architecture (GPT-2 ``c_attn``,
            Llama/Qwen/Mistral ``q_proj`` and ``v_proj``).
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise UsageError(f"lora.r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"lora.dropout must be in [0, 1), got {self.dropout}")


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with trainable LoRA adapters; its own weights are frozen by PEFT."""
    targets = settings.target_modules or DEFAULT_LORA_TARGETS.get(model.config.model_type)
    if targets is None:
        raise UsageError(
            f"no default LoRA target modules for model_type {model.config.model_type!r}: "
            "set lora.target_modules"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class Roles(nn.Module):
    """Policy, reference and critic, in one of the three layouts above (the reward lives apart).

    Args:
        policy: Path of the causal LM to train.
        reference: Path of the frozen reference (default: the policy). Ignored with LoRA.
        value: Path the separate critic is initialised from (default: the policy).
        value_model: ``separate`` or ``shared``; ``None`` builds no critic (critic-free estimators).
        lora: LoRA settings, or ``None`` for full fine-tuning.
        frozen_dtype: ``bf16``/``fp16``/``fp32`` for the frozen weights (reference, LoRA base); None: fp32.
        gradient_checkpointing: Recompute activations in the backward pass to save memory.
        trust_remote_code: Passed to every ``from_pretrained``.
    """

    def __init__(
        self,
        policy: str,
        reference: str | None = None,
        value: str | None = None,
        value_model: str | None = "separate",
        lora: LoraSettings | None = None,
        frozen_dtype: str | None = None,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if value_model is not None and value_model not in VALUE_MODEL_MODES:
            raise UsageError(f"model.value_model must be one of {VALUE_MODEL_MODES}, got {value_model!r}")
        if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
            raise UsageError(
                f"model.frozen_dtype must be one of {sorted(FROZEN_DTYPES)}, got {frozen_dtype!r}"
            )
        dtype = FROZEN_DTYPES.get(frozen_dtype)
        # With LoRA the loaded weights are the frozen base, so they take the frozen dtype. Its adapters
        # move to the base's device as PEFT adds them: a LoRA base is loaded whole even under FSDP2.
        self.policy = load_causal_lm(
            policy, trust_remote_code, dtype if lora else None, deferrable=lora is None
        )
        if gradient_checkpointing:
            # Enabled before PEFT wraps the model, non-reentrant so frozen inputs still get gradients.
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_policy = None
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        else:
            self.ref_policy = freeze(load_causal_lm(reference or policy, trust_remote_code, dtype))
        self.value_model: ValueModel | None = None
        self.value_head: nn.Linear | None = None
        if value_model == "separate":
            self.value_model = ValueModel.from_pretrained(value or policy, trust_remote_code)
            if gradient_checkpointing:
                self.value_model.backbone.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        elif value_model == "shared":
            self.value_head = nn.Linear(self.policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def uses_lora(self) -> bool:
        return isinstance(self.policy, PeftModel)

    def policy_forward(
        self, ids: Tensor, mask: Tensor, pos: Tensor, length: int, with_values: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """(B, length, V) logits of the response tokens and (B, length) values (``None`` without a critic)."""
        if self.value_head is not None and with_values:
            # Shared critic: the values come from the same forward as the logits.
            out = self.policy(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                logits_to_keep=length + 1,
                output_hidden_states=True,
            )
            # in the head's dtype: a LoRA base loaded in bf16 (frozen_dtype) gives bf16 hidden
            # states, which the fp32 head cannot take without autocast (32-true)
            hidden = out.hidden_states[-1][:, -length - 1 : -1].to(self.value_head.weight.dtype)
            # not a view (see ValueModel.forward)
            return out.logits[:, :-1], self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)
        logits = response_logits(self.policy, ids, mask, pos, length)
        if self.value_model is None or not with_values:
            return logits, None
        return logits, self.value_model(ids, mask, pos)[:, -length - 1 : -1]

    @torch.no_grad()
    def reference_logits(self, ids: Tensor, mask: Tensor, pos: Tensor, length: int) -> Tensor:
        """(B, length, V) logits of the frozen reference: a copy, or the LoRA base with the adapter off."""
        if self.ref_policy is None:
            with self.policy.disable_adapter():
                return response_logits(self.policy, ids, mask, pos, length)
        return response_logits(self.ref_policy, ids, mask, pos, length)

    @contextmanager
    def updating(self) -> Iterator[None]:
        """The trained roles in training mode for the update's passes, in eval mode after.

        Hugging Face models load in eval mode, and HF checkpoints blocks (``gradient_checkpointing``)
        only in training mode: without this a full policy and a separate critic checkpointed nothing.
        Dropout is off in every role (models/loading.py), so both modes give the same log-probs.
        Generation and the rollout's no-grad forwards run in eval mode: with checkpointing in training
        mode HF ``generate`` drops the KV cache. The frozen roles stay in eval mode throughout.
        """
        trained = [role for role in (self.policy, self.value_model, self.value_head) if role is not None]
        for role in trained:
            role.train()
        try:
            yield
        finally:
            for role in trained:
                role.eval()

    def critic_parameters(self) -> list[nn.Parameter]:
        """What only the value loss trains: the separate critic's parameters, or the shared value head's
        (the backbone under a shared head is the policy's); none without a critic."""
        roles = (self.value_model, self.value_head)
        return [p for role in roles if role is not None for p in role.parameters() if p.requires_grad]

    @property
    def has_critic(self) -> bool:
        return self.value_model is not None or self.value_head is not None
