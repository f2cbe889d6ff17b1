"""Fixed point and slot packing for P4L's additive encryption (`p4bench_p4l.crypto`), and
big integers as byte tensors for the wire.

Fixed point (reference section 1.2): a value v travels as round(v * 10**10), and the sum
is divided by 10**10 after decryption. A scaled value must satisfy |v * SCALE| < 2**59, so
a sum of up to MAX_SUMMANDS = 16 of them fits a signed 64-bit slot.

Packing: k signed slot values v_0..v_{k-1} form one plaintext X = sum v_i * 2**(64 i)
(balanced digits, X may be negative), encrypted as X mod n. Homomorphic addition adds the
digits slot by slot; after decryption x > n/2 means x - n, then the digits are read back
low slot first. With k = floor((n_bits - 2) / 64) slots (31 for a 2048-bit key), |X| < n/2
always, so the sign is recovered. k = 1 is the unpacked mode: one ciphertext per value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "MAX_SUMMANDS",
    "SCALE",
    "SLOT_BITS",
    "VALUE_BOUND",
    "decode",
    "encode",
    "from_bytes_tensor",
    "max_slots",
    "pack",
    "to_bytes_tensor",
    "unpack",
]

SCALE = 10**10
SLOT_BITS = 64
MAX_SUMMANDS = 16
VALUE_BOUND = 2**59  # |round(v * SCALE)| < VALUE_BOUND, so MAX_SUMMANDS of them stay below 2**63
_HALF_SLOT = 1 << (SLOT_BITS - 1)


def encode(values: np.ndarray) -> np.ndarray:
    """Fixed-point encoding of a 1-D float vector: round(v * SCALE) as int64. Raises
    ValueError for values that are not finite or with |v * SCALE| >= VALUE_BOUND."""
    scaled = np.asarray(values, dtype=np.float64) * SCALE  # float32 widens exactly
    if scaled.ndim != 1:
        raise ValueError(f"expected a 1-D vector, got shape {tuple(scaled.shape)}")
    if not np.all(np.abs(scaled) < VALUE_BOUND):  # also false for NaN
        raise ValueError(
            f"values must be finite with |v| < {VALUE_BOUND / SCALE:.4g} (2**59 / SCALE)"
        )
    return np.rint(scaled).astype(np.int64)


def decode(fixed: np.ndarray) -> np.ndarray:
    """Fixed-point integers (e.g. decrypted sums) back to float64."""
    return np.asarray(fixed, dtype=np.float64) / SCALE


def max_slots(n: int) -> int:
    """Slots per plaintext for modulus n: floor((n_bits - 2) / 64), which keeps |X| < n/2."""
    return max(1, (n.bit_length() - 2) // SLOT_BITS)


def pack(fixed: np.ndarray, slots: int) -> list[int]:
    """Signed plaintexts X_j = sum_i v_{j*slots+i} * 2**(64 i) of int64 slot values (the last block may be short)."""
    fixed = np.asarray(fixed, dtype="<i8")
    out = []
    for start in range(0, len(fixed), slots):
        block = fixed[start : start + slots]
        # Two's complement digits u_i = v_i + 2**64 b_i, with borrow b_i = [v_i < 0]: X = U - sum b_i 2**(64(i+1)).
        unsigned = int.from_bytes(block.tobytes(), "little")
        borrows = int.from_bytes((block < 0).astype("<u8").tobytes(), "little")
        out.append(unsigned - (borrows << SLOT_BITS))
    return out


@lru_cache(maxsize=64)
def _offset(k: int) -> int:
    return sum(_HALF_SLOT << (SLOT_BITS * i) for i in range(k))


def unpack(blocks: Sequence[int], count: int, slots: int) -> np.ndarray:
    """Inverse of `pack`: the `count` int64 slot values of signed plaintexts (|slot| < 2**63)."""
    if len(blocks) != math.ceil(count / slots):
        raise ValueError(f"{len(blocks)} blocks cannot hold {count} values in {slots} slots")
    out = np.empty(count, dtype=np.int64)
    for j, x in enumerate(blocks):
        k = min(slots, count - j * slots)
        # Adding 2**63 to every digit makes them all non-negative, so plain base-2**64 digits are read back.
        shifted = int(x) + _offset(k)
        if not 0 <= shifted < 1 << (SLOT_BITS * k):
            raise ValueError(f"block {j} is out of range: a slot overflowed")
        digits = np.frombuffer(shifted.to_bytes(8 * k, "little"), dtype="<u8")
        out[j * slots : j * slots + k] = (digits ^ np.uint64(_HALF_SLOT)).view(np.int64)
    return out


def to_bytes_tensor(ints: Sequence[int], width_bytes: int) -> torch.Tensor:
    """Non-negative integers as a (len, width_bytes) uint8 tensor, big-endian. ValueError if one does not fit."""
    try:
        data = b"".join(int(x).to_bytes(width_bytes, "big") for x in ints)
    except OverflowError as err:
        raise ValueError(f"an integer is negative or does not fit {width_bytes} bytes") from err
    if not data:
        return torch.empty((len(ints), width_bytes), dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(ints), width_bytes)


def from_bytes_tensor(tensor: torch.Tensor) -> list[int]:
    """Inverse of `to_bytes_tensor`."""
    if tensor.dtype != torch.uint8 or tensor.ndim != 2 or tensor.shape[1] == 0:
        raise ValueError(
            f"expected a (rows, width > 0) uint8 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    width, raw = tensor.shape[1], tensor.contiguous().numpy().tobytes()
    return [int.from_bytes(raw[i : i + width], "big") for i in range(0, len(raw), width)]
