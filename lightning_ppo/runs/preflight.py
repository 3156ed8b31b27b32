"""Checks of a run's inputs that need no model weights, so that they fail before any model loads.

Loading a real policy takes minutes; a wrong path, a prompt plus response longer than the model's
positions, or an unreadable checkpoint should not wait for it. The CLI runs these on the parsed
config; :func:`check_sequence_fits` also runs in the module's ``setup`` for the Python API.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    SingleDeviceXLAStrategy,
    StrategyRegistry,
    XLAStrategy,
)
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from lightning_ppo._moved import old_paths_allowed
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.runs.errors import VLLM_INSTALL_HINT, MissingPathError, UsageError

# Checkpoint-holding roles of PPOLightningModule, by argument name.
MODEL_FIELDS = ("policy", "reference", "value", "reward_model")
# Roles that read the policy's own token ids: a prompt and its response must fit their positions.
# (A reward model with another tokenizer sees a re-tokenised text of another length.)
SAME_TOKEN_FIELDS = ("policy", "reference", "value")
# Files of which a tokenizer folder holds at least one (fast, BPE, WordPiece, SentencePiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# ckpt_path values Lightning resolves itself rather than reading as a path.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")
# Trainer precisions refused before any model loads, and why.
REFUSED_PRECISIONS = {
    name: "Transformer Engine swaps the policy's linear layers for its own, which Hugging Face generation, "
    "the frozen reference copy and LoRA here were never run with; use bf16-mixed (fp32 weights, bf16 "
    "compute) or bf16-true"
    for name in ("transformer-engine", "transformer-engine-float16")
}
# float16 weights and optimizer state, with no loss scaling: AdamW's eps (1e-8) is 0 in float16 and a
# squared gradient below 6e-8 too, so an update divides by 0 (the quickstart at lr 1e-3: NaN after three
# steps); an update of lr 1e-5 is below float16's resolution (2^-11 of the weight) and rounds away.
REFUSED_PRECISIONS["16-true"] = (
    "float16 weights and AdamW state underflow (AdamW's eps 1e-8 and small squared gradients round to 0 "
    "in float16, and steps go NaN) and small updates round away; use 16-mixed (fp32 weights and optimizer "
    "state, float16 compute with loss scaling), bf16-mixed, or bf16-true"
)
# Strategies whose package Lightning looks for only when the Trainer is built, after every model has
# loaded: (strategy class, its package, how to install it).
STRATEGY_PACKAGES = (
    (DeepSpeedStrategy, "deepspeed", "pip install deepspeed"),
    (XLAStrategy, "torch_xla", "pip install torch_xla (see pytorch/xla)"),
    (SingleDeviceXLAStrategy, "torch_xla", "pip install torch_xla (see pytorch/xla)"),
)


def _looks_local(source: str) -> bool:
    """Whether ``source`` can only be a local path (a hub id is ``name`` or ``org/name``)."""
    if source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in source:  # a Windows path
        return True
    # "checkpoints/tiny" where ./checkpoints exists is a folder the user forgot to create, not a repo.
    return "/" in source and os.path.isdir(source.split("/", 1)[0])


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_model_source(field: str, source: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of the model at ``source`` (a folder or a hub name); a usage error names ``field``."""
    path = Path(source).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"{field}: folder {source!r} holds no model (no config.json in it)")
    if path.is_file():
        raise UsageError(f"{field}: {source!r} is a file; expected a model folder or a hub name")
    if not path.exists() and _looks_local(source):
        raise MissingPathError(f"{field}: model folder {source!r} does not exist")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        hub = "is not a local folder, and loading it from the Hugging Face Hub failed"
        where = "cannot be loaded" if path.exists() else hub
        raise UsageError(f"{field}: {source!r} {where}: {_first_line(err)}") from err


def check_tokenizer_source(field: str, source: str) -> None:
    """Fail when a local tokenizer folder is missing or holds no tokenizer; hub names are left to HF."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            files = ", ".join(TOKENIZER_FILES)
            raise UsageError(f"{field}: folder {source!r} holds no tokenizer (none of {files})")
    elif path.is_file():
        raise UsageError(f"{field}: {source!r} is a file; expected a tokenizer folder or a hub name")
    elif _looks_local(source):
        raise MissingPathError(f"{field}: tokenizer folder {source!r} does not exist")


def position_limit(config: PretrainedConfig) -> tuple[str, int] | None:
    """The config field bounding a model's positions and its value; None for models without one."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return name, value
    return None


def check_sequence_fits(
    config: PretrainedConfig,
    field: str,
    max_prompt_length: int | None,
    max_new_tokens: int | None,
    budget_field: str = "model.generation.max_new_tokens",
) -> None:
    """Fail when the longest prompt plus response has more tokens than the model has positions.

    ``max_new_tokens`` is the tokens after the prompt: one reply's, or a multi-turn episode's whole
    budget (``budget_field`` names which setting it came from).

    Past them a learned position table is indexed out of range mid-generation (``IndexError: index
    out of range in self``) and a rotary model runs beyond the lengths it was trained on.
    """
    limit = position_limit(config)
    if limit is None or max_prompt_length is None or max_new_tokens is None:
        return
    name, positions = limit
    total = max_prompt_length + max_new_tokens
    if total > positions:
        raise UsageError(
            f"data.max_prompt_length ({max_prompt_length}) + {budget_field} "
            f"({max_new_tokens}) = {total} tokens, more than the {positions} positions of {field} "
            f"{config.name_or_path!r} ({name} in its config): lower one of them"
        )


def check_checkpoint_file(ckpt_path: str, field: str = "ckpt_path") -> None:
    """Fail, naming ``field``, when ``ckpt_path`` does not exist or is not a checkpoint torch can read.

    Only the file's structure is read (memory-mapped): the weights are loaded later by the Trainer.
    """
    if ckpt_path in SPECIAL_CKPT_PATHS or ckpt_path.startswith("registry:") or "://" in ckpt_path:
        return
    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        return  # sharded (DeepSpeed, distributed) checkpoints are folders the strategy reads itself
    if not path.exists():
        raise MissingPathError(f"{field}: {ckpt_path!r} does not exist")
    with path.open("rb") as file:
        is_zip = file.read(4) == b"PK\x03\x04"  # torch.save's format since torch 1.6
    try:
        # Memory mapping (zip format only) reads the structure without loading every tensor; old
        # class paths allowed as the resume's load allows them (AtomicCheckpointIO)
        with old_paths_allowed():
            torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as err:
        reason = (
            "it holds objects that torch.load(weights_only=True), as Lightning reads it, refuses"
            if is_zip
            else "it is not a file written by torch.save"
        )
        raise UsageError(f"{field}: {ckpt_path!r} is not a readable checkpoint: {reason}") from err
    except Exception as err:  # random bytes fail inside the unpickler in many ways
        reason = "its archive is damaged (truncated?)" if is_zip else "it is not a file written by torch.save"
        raise UsageError(f"{field}: {ckpt_path!r} is not a readable checkpoint: {reason}") from err


def check_run_inputs(model: Mapping[str, Any], data: Mapping[str, Any]) -> None:
    """Check the model and data arguments of a run: model and tokenizer paths, sequence length."""
    trust_remote_code = bool(model.get("trust_remote_code"))
    # Subclasses may give these arguments other types; only paths and hub names are checked.
    configs = {
        name: check_model_source(f"model.{name}", model[name], trust_remote_code)
        for name in MODEL_FIELDS
        if isinstance(model.get(name), str)
    }
    if "reward_model" in configs:
        check_reward_head(model["reward_model"])
    # The module loads its tokenizer from the policy's folder unless model.tokenizer is set.
    tokenizer_field = "tokenizer" if model.get("tokenizer") else "policy"
    tokenizers = {
        f"model.{tokenizer_field}": model.get(tokenizer_field),
        "model.reward_tokenizer": model.get("reward_tokenizer"),
        "data.tokenizer": data.get("tokenizer"),
    }
    for field, source in tokenizers.items():
        if isinstance(source, str):
            check_tokenizer_source(field, source)
    budget_field, budget = response_budget(model)
    for name in SAME_TOKEN_FIELDS:
        if name in configs:
            check_sequence_fits(
                configs[name], f"model.{name}", data.get("max_prompt_length"), budget, budget_field
            )


def response_budget(model: dict[str, Any]) -> tuple[str, int | None]:
    """The setting that bounds the tokens after a prompt, and its value: one reply's
    ``generation.max_new_tokens``, or with an environment or tools the episode's ``episode.max_tokens``."""
    if model.get("environment") is not None or model.get("tools"):
        return "model.episode.max_tokens", (model.get("episode") or {}).get(
            "max_tokens", EpisodeConfig.max_tokens
        )
    return "model.generation.max_new_tokens", (model.get("generation") or {}).get("max_new_tokens")


def check_packages(model: Mapping[str, Any], strategy: Any) -> None:
    """Fail when the generation engine or the Trainer's strategy needs a package that is not installed.

    Found without importing it (vLLM takes seconds to import); the engine and Lightning import it later.
    """
    if (model.get("generation") or {}).get("engine") == "vllm" and find_spec("vllm") is None:
        raise UsageError(
            f"generation.engine 'vllm' needs the vllm package, which is not installed: {VLLM_INSTALL_HINT}"
        )
    cls = strategy_class(strategy)
    for base, package, hint in STRATEGY_PACKAGES:
        if cls is not None and issubclass(cls, base) and find_spec(package) is None:
            shown = strategy if isinstance(strategy, str) else cls.__name__
            raise UsageError(
                f"trainer.strategy {shown!r} needs the {package} package, which is not installed: {hint}"
            )


def check_precision(precision: Any, field: str = "trainer.precision") -> None:
    """Refuse, before any model loads, a Trainer precision this package cannot serve.

    Every other precision Lightning offers runs (tests/test_precision.py: 32-true, 16-mixed, bf16-mixed,
    bf16-true, 64-true, with GPT-2 and the RoPE families).
    """
    if str(precision) in REFUSED_PRECISIONS:
        raise UsageError(f"{field} {precision!r} is not supported: {REFUSED_PRECISIONS[str(precision)]}")


def strategy_class(strategy: Any) -> type | None:
    """The class of ``trainer.strategy`` given as a registered name or a ``class_path``; else None."""
    if isinstance(strategy, str):
        return StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    class_path = getattr(strategy, "class_path", None)
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module_name, _, name = class_path.rpartition(".")
    try:
        found = getattr(import_module(module_name), name)
    except (ImportError, AttributeError):
        return None  # jsonargparse names a class_path that does not import
    return found if isinstance(found, type) else None


def no_head_message(source: str, detail: str) -> str:
    return (
        f"model.reward_model: {source!r} has no scoring head in its weights ({detail}; a causal "
        "LM?): a reward model is a checkpoint of AutoModelForSequenceClassification with num_labels=1"
    )


def check_reward_head(source: str) -> None:
    """Fail, before loading, when a local reward-model folder's safetensors hold no scoring head.

    Loaded as a sequence classifier, such a checkpoint (e.g. a causal LM) gets a randomly initialised
    head, and the critic would start from it too. Heads are ``score`` or ``classifier`` (as
    :func:`~lightning_ppo.models.loading.classifier_head` reads them); other formats are checked when loading.
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
