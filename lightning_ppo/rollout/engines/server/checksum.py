"""One tensor's checksum, (sum, sum of squares) in float64, a bounded chunk at a time.

A server computes it beside vLLM's 90 % of its GPU's memory, so it never copies a whole tensor:
a float64 copy of Qwen2.5-7B's embedding alone is 4.4 GB (8.7 GB with its square). Each chunk of at
most ``CHUNK`` elements is copied to float64 (``CHUNK`` x 8 bytes, 32 MiB, the peak extra memory)
and its squares summed by a dot product (no second copy). The values and their squares are exact in
float64 (float32/bf16 values), so the chunked sums differ from one whole sum only by the rounding of
the order they are added in: at most ~1.1e-16 x log2(numel) of sqrt(numel x sum of squares), far
below :data:`.weight_sync._TOLERANCE` (1e-12). Imports only torch: it runs inside the server.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 1 << 22  # elements: 32 MiB in float64

Checksum = tuple[float, float]  # (sum, sum of squares) in float64


@torch.no_grad()
def checksum(tensor: Tensor, chunk: int = CHUNK) -> Checksum:
    """``tensor``'s (sum, sum of squares) in float64, copying at most ``chunk`` elements at a time."""
    flat = tensor.detach()
    flat = flat.reshape(-1) if flat.is_contiguous() else flat  # a view; a strided tensor goes by rows
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    squares = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for piece in _pieces(flat, chunk):
        values = piece.reshape(-1).double()  # piece is contiguous or at most `chunk` elements
        total += values.sum()
        squares += torch.dot(values, values)
    return total.item(), squares.item()


def _pieces(tensor: Tensor, chunk: int):
    """Slices of ``tensor`` along its first dimension of at most ``chunk`` elements each, recursing
    into a row too large for one chunk."""
    if tensor.dim() == 0:
        yield tensor
        return
    row = max(tensor[0].numel(), 1) if tensor.shape[0] else 1
    if row > chunk and tensor.dim() > 1:
        for index in range(tensor.shape[0]):
            yield from _pieces(tensor[index], chunk)
        return
    rows = max(chunk // row, 1)
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows]
