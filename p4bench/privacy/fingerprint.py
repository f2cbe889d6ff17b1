"""Exact fingerprints of tensor rows: what the run-size verification keeps instead of values.

A replay at the run's own size compares every message and every clipped sum of the run,
bit for bit. Keeping them all would cost the run's whole traffic in memory; a fingerprint
costs 16 bytes a row. Each row's bits (the float's own bit pattern, so -0.0 and 0.0, or
two NaNs, differ exactly as their bytes do) are read as integers and folded with two
fixed vectors of random odd 64-bit weights, modulo 2^64. Two rows that differ give the
same pair with probability about 2^-64 per weight vector (for any fixed difference of
bits whose low bits are not all zero; a difference divisible by 2^k loses k bits), so a
difference is missed only by a coincidence of that order, never by construction. The
weights are fixed: a fingerprint in the recorded run and one in its replay are comparable.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["row_fingerprints", "row_norms"]

_CHUNK = 1 << 20  # elements folded at once (bounds the int64 temporaries to 8 MiB)
_WEIGHTS: dict[int, torch.Tensor] = {}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _weights(width: int) -> torch.Tensor:
    """(2, width) int64 odd weights, the same in every process (a fixed generator)."""
    cached = _WEIGHTS.get(width)
    if cached is None:
        generator = torch.Generator().manual_seed(0x5EED_F1A6)
        cached = (
            torch.randint(-(2**62), 2**62, (2, width), generator=generator, dtype=torch.int64) * 2
            + 1
        )
        _WEIGHTS[width] = cached
    return cached


def row_fingerprints(values: torch.Tensor) -> npt.NDArray[np.int64]:
    """(rows, 2) int64: each row of `values` (rows, ...) folded from its bits, as a numpy
    array in numpy's own memory (what a check keeps for the whole run: small buffers of
    torch's held that long fragmented its heap, the resident set growing by a megabyte an
    exchange; numpy's own do not).

    Rows of another dtype or width have other fingerprints only by their bits: callers
    compare shapes and dtypes themselves."""
    rows = int(values.shape[0]) if values.dim() else 1
    flat = values.detach().reshape(rows, -1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = (
        flat.contiguous().view(_INTS[flat.element_size()])
        if flat.dtype not in _INTS.values()
        else flat
    )
    ints = ints.cpu()
    width = int(ints.shape[1])
    weights = _weights(width)
    result = torch.zeros(rows, 2, dtype=torch.int64)
    if not width or not rows:
        return result.numpy().copy()
    step = max(1, _CHUNK // width)
    for start in range(0, rows, step):
        part = ints[start : start + step].to(torch.int64)
        # int64 products and sums wrap modulo 2^64: the fold is exact and order-free
        result[start : start + step, 0] = (part * weights[0]).sum(1)
        result[start : start + step, 1] = (part * weights[1]).sum(1)
    return (
        result.numpy().copy()
    )  # numpy's own memory: torch's small buffers held a whole run fragment its heap


def row_norms(values: torch.Tensor) -> npt.NDArray[np.float64]:
    """(rows,) float64 L2 norms of each row (NaN and inf kept), for a finding's magnitude."""
    rows = int(values.shape[0]) if values.dim() else 1
    flat = values.detach().reshape(rows, -1)
    if not flat.shape[1]:
        return np.zeros(rows, dtype=np.float64)
    # in the values' own precision where they are floats: no full-size copy (a figure for a finding only)
    norms: npt.NDArray[np.float64] = (
        (flat if flat.is_floating_point() else flat.double()).norm(dim=1).double().cpu().numpy()
    )
    return norms.copy()
