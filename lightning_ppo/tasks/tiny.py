"""Tiny local checkpoints built from configs: no download, real ``save_pretrained`` on disk.

The quickstart, the example configs and the tests load these by path, so the same
``from_pretrained`` code that loads a real model is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lightning_ppo.runs.file_modes import save_pretrained

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
DEFAULT_ALPHABET = "0123456789=+-*/:;,.?! abcdefghijklmnopqrstuvwxyz"
# The rotary-embedding (RoPE) families, whose keys leave the rotation in fp32 under autocast.
ROPE_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
ARCHS = ("gpt2", *ROPE_ARCHS)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``alphabet`` plus pad, eos, bos."""
    specials = [PAD, EOS, BOS]
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, bos_token=BOS)


@dataclass
class TinyModelSpec:
    """Size of a tiny causal LM.

    Args:
        arch: ``gpt2`` or one of the RoPE families ``llama``, ``qwen2`` (biased q/k/v projections),
            ``mistral`` (sliding-window attention, here a window shorter than ``n_positions``).
        n_layer: Transformer blocks.
        n_embd: Hidden width.
        n_head: Attention heads.
        n_positions: Maximum sequence length.
    """

    arch: str = "gpt2"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_positions: int = 128


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _gpt2_config(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec, **extra: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_layer=spec.n_layer,
        n_embd=spec.n_embd,
        n_head=spec.n_head,
        n_positions=spec.n_positions,
        **_special_ids(tokenizer),
        **extra,
    )


def build_tiny_causal_lm(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec, seed: int = 0):
    """A randomly initialised causal LM sized by ``spec`` for ``tokenizer``'s vocabulary."""
    torch.manual_seed(seed)
    ids = _special_ids(tokenizer)
    if spec.arch == "gpt2":
        return GPT2LMHeadModel(_gpt2_config(tokenizer, spec))
    if spec.arch in ROPE_ARCHS:
        config_class, model_class = ROPE_ARCHS[spec.arch]
        config = config_class(
            vocab_size=len(tokenizer),
            num_hidden_layers=spec.n_layer,
            hidden_size=spec.n_embd,
            intermediate_size=4 * spec.n_embd,
            num_attention_heads=spec.n_head,
            # grouped-query attention where the family uses it: two query heads per key/value head
            num_key_value_heads=spec.n_head if spec.arch == "llama" else max(1, spec.n_head // 2),
            max_position_embeddings=spec.n_positions,
            **ids,
            **({"sliding_window": spec.n_positions // 2} if spec.arch == "mistral" else {}),
        )
        return model_class(config)
    raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")


def build_tiny_reward_model(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec, seed: int = 0):
    """A randomly initialised GPT-2 sequence classifier with one output: a (random) reward model."""
    torch.manual_seed(seed)
    config = _gpt2_config(tokenizer, spec, num_labels=1)
    return GPT2ForSequenceClassification(config)


def make_tiny_checkpoint(
    out_dir: str | Path,
    spec: TinyModelSpec | None = None,
    alphabet: str = DEFAULT_ALPHABET,
    seed: int = 0,
    kind: str = "causal-lm",
) -> Path:
    """Write a tokenizer and a random tiny model to ``out_dir`` with ``save_pretrained``.

    ``kind`` is ``causal-lm`` (a policy) or ``reward`` (a one-output sequence classifier).
    """
    builders = {"causal-lm": build_tiny_causal_lm, "reward": build_tiny_reward_model}
    if kind not in builders:
        raise ValueError(f"kind must be one of {sorted(builders)}, got {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(alphabet)
    model = builders[kind](tokenizer, spec or TinyModelSpec(), seed)
    save_pretrained(model, out)  # its weights readable by others, as the files beside them
    tokenizer.save_pretrained(out)
    return out
