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

from lightning_ppo.runs.file_modes import open_mode

Checksum = tuple[float, float]  # (sum, sum of squares) in float64

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


def checksum(tensor: Tensor) -> Checksum:
    values = tensor.detach().double()
    return values.sum().item(), values.square().sum().item()


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


def mismatch(
    written: Mapping[str, Checksum], held: Mapping[str, list[float]], packed: Mapping[str, list[str]]
) -> str | None:
    """``None`` when every parameter the server holds sums as the trainer's weights do, else what
    differs first (a name and both checksums). A sync that covered no parameter at all differs too."""
    expected = expected_checksums(written, held, packed)
    if not expected:
        return f"none of its {len(held)} parameters matches a name of the {len(written)} written"
    covered = {part for name in expected for part in _sources(name, written, packed)}
    missing = sorted(set(written) - covered)
    if missing:
        return f"it holds no parameter for {missing[0]!r} ({len(missing)} written tensors unmatched)"
    for name, (total, squares) in expected.items():
        got_total, got_squares = held[name][0], held[name][1]
        scale = math.sqrt(max(held[name][2], 1.0) * max(squares, got_squares)) + 1e-30
        if abs(got_total - total) > _TOLERANCE * scale or abs(got_squares - squares) > _TOLERANCE * (
            squares + 1e-30
        ):
            return (
                f"parameter {name!r} holds sum {got_total:.9g} / sum of squares {got_squares:.9g}, "
                f"the trainer's weights {total:.9g} / {squares:.9g}"
            )
    return None
