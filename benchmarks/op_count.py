"""Count what the host asks of the device: every aten op dispatched, and every host read.

On a GPU each aten op is a kernel launch the host pays for one by one, and each host read (a
``.item()``, ``float()``/``bool()`` of a tensor, a ``.tolist()``, a copy to the CPU) waits for all
queued work to finish. Both can be counted on CPU, where the count does not depend on the machine:
the ops through a ``TorchDispatchMode``, the reads as below.

Host reads counted:

* ``aten._local_scalar_dense``: ``.item()``, ``float()``, ``int()``, ``bool()`` of a tensor;
* ``aten._to_copy`` (``.to``/``.cpu()``) from a non-CPU tensor to the CPU (seen on GPUs only: on
  CPU ``.cpu()`` returns the tensor itself and dispatches nothing);
* ``Tensor.tolist()`` and ``Tensor.numpy()``, which read memory without dispatching any op: they are
  counted by wrapping the two methods while the counter is active. On CPU every tensor is a host
  tensor, so this counts each call as a read, also of tensors that would stay on the host on a GPU:
  code on the hot path keeps host-side data as Python lists or NumPy arrays, never as tensors.

    with OpCounter() as count:
        ...
    count.ops, count.host_reads, count.by_op  # totals, and ops by name ("aten.sum.dim_IntList")
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Methods that read a tensor's memory on the host without dispatching an op.
UNDISPATCHED_READS = ("tolist", "numpy")
LOCAL_SCALAR = "aten._local_scalar_dense.default"


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name and host reads while active (a context manager; re-entrant per use).

    ``mark()`` records the totals so far; :meth:`per_interval` gives the counts between marks
    (an iteration each, when the caller marks the end of every iteration).
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.undispatched_reads = 0
        self.device_copies = 0
        self.marks: list[tuple[int, int]] = []
        self.name_marks: list[Counter[str]] = []
        self._saved: dict[str, Any] = {}

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def host_reads(self) -> int:
        return self.by_op[LOCAL_SCALAR] + self.undispatched_reads + self.device_copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.by_op[str(func)] += 1
        if func is torch.ops.aten._to_copy.default and _device_to_host(args, kwargs):
            self.device_copies += 1
        return func(*args, **kwargs)

    def __enter__(self) -> OpCounter:
        for name in UNDISPATCHED_READS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()

    def _counted(self, method: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.undispatched_reads += 1
            return method(tensor, *args, **kwargs)

        return read

    def mark(self) -> None:
        self.marks.append((self.ops, self.host_reads))
        self.name_marks.append(Counter(self.by_op))

    def per_interval(self) -> list[tuple[int, int]]:
        """(ops, host reads) between consecutive marks."""
        return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def by_name_per_interval(self) -> list[dict[str, int]]:
        """The ops by name between consecutive marks."""
        return [dict(b - a) for a, b in zip(self.name_marks, self.name_marks[1:], strict=False)]


def _device_to_host(args: tuple, kwargs: dict) -> bool:
    source = args[0] if args else None
    target = kwargs.get("device")
    return (
        isinstance(source, torch.Tensor)
        and source.device.type != "cpu"
        and target is not None
        and torch.device(target).type == "cpu"
    )


def steady_per_iteration(counts: list[tuple[int, int]]) -> tuple[float, float]:
    """(ops, host reads) per iteration from per-iteration counts, the first (lazy set-up: optimizer
    state, caches) left out; the median, which equals the difference of two runs of different
    lengths divided by the difference of their lengths when every later iteration does the same."""
    steady = counts[1:] or counts
    if not steady:
        return float("nan"), float("nan")
    ops = sorted(c[0] for c in steady)
    reads = sorted(c[1] for c in steady)
    mid = len(steady) // 2
    if len(steady) % 2:
        return float(ops[mid]), float(reads[mid])
    return (ops[mid - 1] + ops[mid]) / 2, (reads[mid - 1] + reads[mid]) / 2
