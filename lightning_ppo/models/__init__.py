"""The roles PPO trains and freezes: loading Hugging Face checkpoints (``loading``: policy, value
model, reward model, tokenizer, stop token), their layouts and LoRA (``roles``), and reading their
weights where they run (``placement``). May import ``distributed/``, ``runs/`` and ``config``.

``lightning_ppo.models`` was one module before it was a folder; its names still import from here.
"""

from lightning_ppo._moved import forwarding

__getattr__ = forwarding(
    __name__,
    dict.fromkeys(
        (
            "FROZEN_DTYPES",
            "FUSED_ACTIVATIONS",
            "load_config",
            "disable_dropout",
            "freeze",
            "load_pretrained",
            "load_causal_lm",
            "classifier_head",
            "ValueModel",
            "response_logits",
            "load_tokenizer",
            "resolve_stop_token",
            "resolve_suppressed_tokens",
            "token_pattern",
        ),
        "lightning_ppo.models.loading",
    ),
)
