"""Moving the policy's weights into generation servers, and proving they arrived.

The trainer writes the weights (Hugging Face names, the server's dtype) to one safetensors file,
atomically (a server never reads a half-written file), readable by the servers whatever user they
run as (safetensors writes 0600: ``runs/file_modes``), and every server loads it in place
(:class:`.worker_extension.WeightSyncExtension`) and answers with per-parameter checksums of what its
kernels now hold. :func:`mismatch` compares them with the trainer's own: a sync that moved nothing
or moved the wrong tensors names the first parameter that differs. A "did the output change" test
would pass a sync that moved nothing (vllm#57022); a checksum of the weights held does not.

The checksums (sum and sum of squares in float64) do not depend on how the engine lays a tensor
out: GPT-2's transposed Conv1D weights, Llama's q/k/v fused into one ``qkv_proj``, a vocabulary
padded with zero rows all sum alike. They would not see two values swapped inside one parameter.
A mixture-of-experts layer that vLLM stacks (``experts.w13_weight``, ``w2_weight``) is checked as
one whole: what the server's ``experts`` module holds against every tensor written under it. A
tensor the server holds in another form (quantized, fp8) or under another name (a vision model's
mapper) cannot be followed by its sum: :func:`unchecked` says so in one line, and such a sync is
proven by the version the worker sets only once vLLM's load returned, never refused.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from lightning_ppo.rollout.engines.server.checksum import Checksum, checksum
from lightning_ppo.runs.file_modes import open_mode

__all__ = ["Checksum", "WrittenWeights", "checksum", "mismatch", "unchecked", "write_weights"]


# Relative to sqrt(numel x sum of squares) (which bounds the sum of |values|). The values are exact in
# float64 (float32/bf16 values and their squares), so two sums of them differ only by the rounding
# of the order they are added in: ~1e-16 x log2(numel) of it (measured 0 and 9e-16 on a server).
# One weight of a 256 x 256 layer moved by 1e-6 of its size is 15x this tolerance.
_TOLERANCE = 1e-12


@dataclass(frozen=True)
class WrittenWeights:
    """A weights file for the servers, and the checksums they must report after loading it."""

    path: Path
    checksums: dict[str, Checksum]
    bytes: int


# Then the writing machine's name, its process (:func:`_owner`), a random hex.
_PREFIX = "lightning-ppo-weights-"


def write_weights(
    weights: Iterable[tuple[str, Tensor]], folder: Path, dtype: torch.dtype, with_checksums: bool = True
) -> WrittenWeights:
    """Write ``weights`` in ``dtype`` (the server's, so each rounds once, here) to a new file in
    ``folder``: written under a temporary name and renamed, so the name appears only when whole; a
    write that fails leaves nothing behind. Their checksums where asked (a sync that is checked)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to(device="cpu", dtype=dtype).contiguous() for name, tensor in weights}
    name = f"{_PREFIX}{socket.gethostname()}-{_owner(os.getpid())}-{uuid.uuid4().hex}"
    partial, path = folder / f".{name}.partial", folder / f"{name}.safetensors"
    try:
        save_file(tensors, str(partial))
        os.chmod(partial, open_mode(folder))
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    sums = {name: checksum(tensor) for name, tensor in tensors.items()} if with_checksums else {}
    return WrittenWeights(path, sums, sum(t.numel() * t.element_size() for t in tensors.values()))


def sweep_leftovers(folder: Path) -> list[Path]:
    """Remove the weight files a killed run left in ``folder`` (between its write and its unlink):
    this user's, written on this machine since it booted, in this PID namespace, by a process no
    longer running. A process id means something only in its namespace: containers that share a
    hostname and a folder see each other's files, not each other's processes, so another
    namespace's files (and another machine's, another boot's, another user's, or those of a version
    that did not name its namespace) are left alone: none is provably stale. The files removed."""
    removed, here, ours = [], socket.gethostname(), _owner(0).rpartition(".")[0]
    for path in folder.glob(f"*{_PREFIX}{here}-*"):
        owner = path.name.lstrip(".").removeprefix(f"{_PREFIX}{here}-").split("-", 1)[0]
        place, _, pid = owner.rpartition(".")  # this boot and namespace, or another's
        if place != ours or not pid.isdigit() or _running(int(pid)):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            if path.stat().st_uid == os.getuid():
                path.unlink()
                removed.append(path)
    return removed


def _owner(pid: int) -> str:
    """Process ``pid`` of this machine's boot and this PID namespace, as a file's name says it:
    ``<boot id>.<namespace inode>.<pid>`` (0 for what the system does not tell)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
    except OSError:
        boot = "0"
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{boot}.{namespace}.{pid}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def expected_checksums(
    written: Mapping[str, Checksum], held_names: Iterable[str], packed: Mapping[str, list[str]]
) -> dict[str, Checksum]:
    """What each of the server's parameters must sum to, from the trainer's tensors: its own name,
    or (a fused parameter, vLLM's ``packed_modules_mapping``) the sum of the tensors fused into it.
    A server parameter with no counterpart (a buffer-like parameter the checkpoint lacks) is left out."""
    expected = {}
    for name in held_names:
        parts = _sources(name, written, packed)
        if parts:
            expected[name] = (sum(written[p][0] for p in parts), sum(written[p][1] for p in parts))
    return expected


def _sources(name: str, written: Mapping[str, Checksum], packed: Mapping[str, list[str]]) -> list[str]:
    if name in written:
        return [name]
    module, _, leaf = name.rpartition(".")
    parent, _, fused = module.rpartition(".")
    for part in packed.get(fused, ()):
        if f"{parent}.{part}.{leaf}" not in written:
            return []
    return [f"{parent}.{part}.{leaf}" for part in packed.get(fused, ())]


def combine_workers(answers: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """One server's checksums from its workers' (one per tensor-parallel rank): a parameter every
    worker reports alike is replicated (a norm, a row-parallel bias) and counts once; one whose
    workers differ is sharded, and its shards' sums add up to the whole tensor's."""
    combined = {}
    for name in answers[0]:
        parts = [answer[name] for answer in answers]
        same = all(part == parts[0] for part in parts)
        combined[name] = list(parts[0]) if same else [sum(column) for column in zip(*parts, strict=True)]
    return combined


@dataclass(frozen=True)
class _Groups:
    """Which of the server's parameters are checked against which written tensors."""

    single: dict[str, Checksum]  # a parameter by its own name, or fused (packed_modules_mapping)
    stacked: dict[str, tuple[list[str], list[str]]]  # a module: its parameters, the tensors under it
    unfollowed: list[str]  # written tensors no parameter's sum can be followed to


def _groups(written: Mapping[str, Checksum], held: Mapping[str, list[float]], packed: Mapping) -> _Groups:
    single = expected_checksums(written, held, packed)
    covered = {part for name in single for part in _sources(name, written, packed)}
    left = sorted(set(written) - covered)
    stacked: dict[str, tuple[list[str], list[str]]] = {}
    for name in sorted(set(held) - set(single)):
        module = name.rpartition(".")[0]  # vLLM's `...mlp.experts`, holding every expert stacked
        under = [tensor for tensor in left if module and tensor.startswith(f"{module}.")]
        if under or module in stacked:
            params, tensors = stacked.setdefault(module, ([], []))
            params.append(name)
            tensors.extend(t for t in under if t not in tensors)
    grouped = {tensor for _, tensors in stacked.values() for tensor in tensors}
    return _Groups(single, stacked, [tensor for tensor in left if tensor not in grouped])


def unchecked(
    written: Mapping[str, Checksum], held: Mapping[str, list[float]], packed: Mapping[str, list[str]]
) -> str | None:
    """One line on the written tensors whose sums no parameter of the server can be followed to
    (held quantized, or renamed by the model's mapper), ``None`` where every one is checked."""
    left = _groups(written, held, packed).unfollowed
    if not left:
        return None
    return (
        f"checksums cannot follow {len(left)} of the {len(written)} written tensors (first {left[0]!r}): "
        "the server holds them quantized or under other names; verified for them: the server's load "
        "returned and it holds this sync's weights version"
    )


def mismatch(
    written: Mapping[str, Checksum], held: Mapping[str, list[float]], packed: Mapping[str, list[str]]
) -> str | None:
    """``None`` when every parameter the server holds that the written tensors can be followed to
    sums as they do (:func:`unchecked` names the rest), else what differs first (a name and both
    checksums)."""
    groups = _groups(written, held, packed)
    wholes = {name: (total, squares, held[name][2]) for name, (total, squares) in groups.single.items()}
    for module, (params, tensors) in groups.stacked.items():
        total, squares = sum(written[t][0] for t in tensors), sum(written[t][1] for t in tensors)
        got = [sum(held[p][i] for p in params) for i in range(3)]
        label = f"{module}.{{{','.join(p.rpartition('.')[2] for p in params)}}}"
        if not tensors or _differs((total, squares), got):
            return _differ_line(label, (total, squares), got)
    for name, (total, squares, numel) in wholes.items():
        if _differs((total, squares), [held[name][0], held[name][1], numel]):
            return _differ_line(repr(name), (total, squares), held[name])
    return None


def _differs(expected: Checksum, got: list[float]) -> bool:
    (total, squares), (got_total, got_squares, numel) = expected, got[:3]
    scale = math.sqrt(max(numel, 1.0) * max(squares, got_squares)) + 1e-30
    return abs(got_total - total) > _TOLERANCE * scale or abs(got_squares - squares) > _TOLERANCE * (
        squares + 1e-30
    )


def _differ_line(label: str, expected: Checksum, got: list[float]) -> str:
    return (
        f"parameter {label} holds sum {got[0]:.9g} / sum of squares {got[1]:.9g}, "
        f"the trainer's weights {expected[0]:.9g} / {expected[1]:.9g}"
    )
