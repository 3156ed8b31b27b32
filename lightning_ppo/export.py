"""Export the trained policy of a checkpoint as a Hugging Face model folder.

``lightning-ppo export CHECKPOINT --out DIR`` writes a folder that
``AutoModelForCausalLM.from_pretrained(DIR)`` loads: LoRA adapters merged into the base by
default (or kept as a PEFT adapter with ``--keep-adapter``), the tokenizer, and the critic's
value head beside it when the run trained a critic (``value_head.pt``: the head of a shared critic,
or the whole state of a separate one; critic-free estimators have none). The run's
``generation.suppress_tokens`` go into its ``generation_config.json`` (see :func:`sampling_config`).
The weights are written in the dtype the run trained them in (``--dtype`` chooses another), not the
base checkpoint's: a bf16-saved base would round an fp32 fine-tune's small updates away.

A policy that runs code of its own (its ``config.json``'s ``auto_map``: a hub model loaded with
``trust_remote_code``) is loaded only with ``--trust-remote-code``, as ``from_pretrained`` asks of
whoever loads it; the checkpoint's record that its run trusted that code never turns it on by
itself (a checkpoint file is data, and may come from someone else), it only names the flag. The
folder written carries that code, so it loads with ``trust_remote_code=True`` too.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lightning_ppo._moved import old_paths_allowed
from lightning_ppo.models.loading import FROZEN_DTYPES, load_tokenizer, resolve_suppressed_tokens
from lightning_ppo.models.roles import LoraSettings, apply_lora
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.file_modes import save_pretrained
from lightning_ppo.runs.preflight import check_checkpoint_file

POLICY_PREFIX = "roles.policy."
CRITIC_PREFIXES = ("roles.value_head.", "roles.value_model.")


def load_trained_policy(checkpoint: dict, trust_remote_code: bool = False) -> PreTrainedModel:
    """Rebuild the policy a checkpoint trained: its base from the saved path, its weights from the file,
    in the trained weights' dtype (:func:`trained_dtype`); its own code run only if ``trust_remote_code``."""
    hparams = checkpoint["hyper_parameters"]
    trained = {
        k[len(POLICY_PREFIX) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(POLICY_PREFIX)
    }
    # The user's own config (dropout, activation), not the training-time one load_causal_lm makes:
    # it is the config the exported folder will carry. Without a dtype transformers would load the
    # base in the dtype it was saved in, and load_state_dict would cast the trained weights to it.
    with _remote_code_named(hparams):
        model = AutoModelForCausalLM.from_pretrained(
            hparams["policy"], dtype=trained_dtype(trained), trust_remote_code=trust_remote_code
        )
    if hparams.get("lora"):
        model = apply_lora(model, LoraSettings(**hparams["lora"]))
    # Frozen base weights are not in the checkpoint (they are the files at hparams["policy"]).
    _, unexpected = model.load_state_dict(trained, strict=False)
    if unexpected:
        raise ValueError(
            f"the checkpoint's policy weights do not fit {hparams['policy']!r}: {unexpected[:5]}"
        )
    return model


@contextmanager
def _remote_code_named(hparams: dict[str, Any]) -> Iterator[None]:
    """transformers' refusal of a policy's own code (a ``ValueError``; never its prompt on a terminal:
    the flag is always given) as one line naming the export's flag."""
    try:
        yield
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        trusted = hparams.get("trust_remote_code")  # absent from checkpoints written before it was kept
        trusted = ", which its run trusted (trust_remote_code: true)" if trusted else ""
        raise UsageError(
            f"export: the policy {hparams['policy']!r} runs code of its own (an auto_map in its config "
            f"files){trusted}: pass --trust-remote-code to run it here, if you trust it"
        ) from err


def trained_dtype(trained: dict[str, torch.Tensor]) -> torch.dtype | str:
    """The float dtype most of the trained weights' values are in (fp32 for a run's policy or LoRA
    adapters, which merge into a base upcast to it; bf16 for a bf16-true run, whatever a small buffer
    kept in fp32 says); ``"auto"`` (the base checkpoint's) when the file holds none."""
    counts: dict[torch.dtype, int] = {}
    for tensor in trained.values():
        if tensor.dtype.is_floating_point:
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=lambda dtype: (counts[dtype], dtype.itemsize)) if counts else "auto"


def export_dtype(name: str | None) -> torch.dtype | None:
    """``--dtype``'s name (``fp32``, ``bf16``, ``fp16``) as a torch dtype; None (the trained one) stays."""
    if name is None:
        return None
    if name not in FROZEN_DTYPES:
        raise UsageError(f"export --dtype must be one of {sorted(FROZEN_DTYPES)}, got {name!r}")
    return FROZEN_DTYPES[name]


def read_checkpoint(
    path: Path, prefixes: tuple[str, ...] = (POLICY_PREFIX, *CRITIC_PREFIXES)
) -> dict[str, Any]:
    """A checkpoint file, or a sharded checkpoint folder (FSDP2's ``ModelParallelStrategy``) read on
    the CPU, in one process, with no process group.

    Of a folder only the weights whose names start with ``prefixes`` are read (the policy's and the
    critic's; not the optimizer state or any other role), whole tensors put together from their
    shards, with the non-tensor state (hyper-parameters) from ``meta.pt``.
    """
    if not path.is_dir():
        with old_paths_allowed():
            return torch.load(path, map_location="cpu", weights_only=True)
    if not (path / _METADATA_FILENAME).is_file():
        raise UsageError(f"checkpoint: {str(path)!r} is a folder but not a sharded checkpoint (no meta.pt)")
    reader = FileSystemReader(path)
    wanted = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        name = key.removeprefix("state_dict.")
        if name != key and name.startswith(prefixes) and isinstance(item, TensorStorageMetadata):
            wanted[name] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"state_dict": wanted}, storage_reader=reader)  # reads these keys' bytes only
    with old_paths_allowed():
        checkpoint = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = wanted
    return checkpoint


@dataclass
class Exported:
    """What :func:`export_policy` wrote, and where."""

    out: Path
    adapter: bool  # a PEFT adapter folder rather than a full (merged) model
    value_head: bool  # ``value_head.pt``: only for runs that trained a critic
    suppressed: int = 0  # token ids written to generation_config.json's suppress_tokens
    dtype: torch.dtype = torch.float32  # of the weights written

    def describe(self) -> str:
        """What was written, in words (the ``export`` command's last line)."""
        policy = "the trained policy" + (" as a LoRA adapter" if self.adapter else "")
        parts = [f"{policy} in {str(self.dtype).removeprefix('torch.')}", "its tokenizer"]
        if self.suppressed:
            parts.append(f"its generation config ({self.suppressed} suppressed tokens)")
        if self.value_head:
            parts.append("the critic (value_head.pt)")
        return ", ".join(parts[:-1]) + " and " + parts[-1]


def export_policy(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    keep_adapter: bool = False,
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> Exported:
    """Write the trained policy (LoRA merged unless ``keep_adapter``) in ``dtype`` (``fp32``, ``bf16``,
    ``fp16``; None: the trained weights' own), tokenizer and the critic's weights (if the run trained one).
    ``trust_remote_code``: run the policy's and its tokenizer's own code, if they have any."""
    path = Path(checkpoint_path)
    wanted = export_dtype(dtype)  # a wrong name fails before the checkpoint is read
    check_checkpoint_file(str(path), field="checkpoint")
    checkpoint = read_checkpoint(path)
    if "hyper_parameters" not in checkpoint or "policy" not in checkpoint["hyper_parameters"]:
        raise UsageError(
            f"{str(path)!r} is not a lightning_ppo checkpoint (no policy in its hyper_parameters)"
        )
    model = load_trained_policy(checkpoint, trust_remote_code)
    if checkpoint["hyper_parameters"].get("lora") and not keep_adapter:
        model = model.merge_and_unload()
    if wanted is not None:  # after merging: the adapters' delta is added at full precision, rounded once
        model = model.to(wanted)
    hparams = checkpoint["hyper_parameters"]
    with _remote_code_named(hparams):
        tokenizer = load_tokenizer(hparams.get("policy_tokenizer") or hparams["policy"], trust_remote_code)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)  # its weights readable by others, as the files beside them
    tokenizer.save_pretrained(out)
    generation = sampling_config(model, hparams, tokenizer)
    if generation is not None:  # after the model: it replaces the policy's own generation_config.json
        generation.save_pretrained(out)
    critic = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith(CRITIC_PREFIXES)}
    if critic:
        torch.save(critic, out / "value_head.pt")
    suppressed = len(generation.suppress_tokens) if generation is not None else 0
    adapter = bool(hparams.get("lora")) and keep_adapter
    return Exported(out, adapter, bool(critic), suppressed, next(model.parameters()).dtype)


def sampling_config(
    model: PreTrainedModel, hparams: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> GenerationConfig | None:
    """The policy's own generation config plus the run's suppressed tokens; None if it suppressed none.

    The run never sampled those tokens, and their logits were masked out of every log-prob, so
    training never pushed their probability down: served without the mask, the exported model would
    sample them. Only these are written. Temperature, top-k and top-p are choices of whoever
    samples (greedy decoding, another temperature) and leave the trained distribution as it is.
    """
    tokens = (hparams.get("generation") or {}).get("suppress_tokens") or []
    if not tokens:
        return None
    ids = resolve_suppressed_tokens(tokenizer, tokens)  # patterns too, against the same tokenizer
    config = copy.deepcopy(model.generation_config)  # a PeftModel forwards it from its base
    config.suppress_tokens = sorted(set(config.suppress_tokens or []) | set(ids))
    return config


def export_main(argv: list[str]) -> Exported:
    """``lightning-ppo export CHECKPOINT --out DIR [--keep-adapter] [--dtype D] [--trust-remote-code]``."""
    parser = argparse.ArgumentParser(prog="lightning-ppo export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint",
        help="a .ckpt file or sharded folder from lightning-ppo fit (e.g. runs/x/checkpoints/last.ckpt)",
    )
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--keep-adapter", action="store_true", help="save LoRA as a PEFT adapter, not merged")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the policy's own code (its config's auto_map), as the run did; only if you trust it",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(FROZEN_DTYPES),
        help="dtype of the written weights (default: the trained weights', fp32 for a run's policy)",
    )
    ns = parser.parse_args(argv)
    return export_policy(ns.checkpoint, ns.out, ns.keep_adapter, ns.dtype, ns.trust_remote_code)
