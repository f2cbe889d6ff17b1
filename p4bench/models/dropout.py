"""Dropout for functional models, the same on every runtime.

A model's `forward(params, x)` gets no random stream, and a mask drawn from torch's global
generator would differ between the batched simulator, the per-client reference, the
per-example clipping path and a device peer. So the mask is a hash instead: unit u of
example x is dropped when mix(key(x), salt(params), u) / 2^32 < p, where key(x) hashes the
example's own features and salt(params) the model's current parameters (they change every
step). The mask then varies from step to step, example to example and client to client,
and is a function of one example and the model alone: every runtime and every batching of
the examples gives the same masks, and a per-example gradient still depends on its own
record alone (DP clipping and its sensitivity are unchanged).

Dropout acts only where the harness computes training gradients (`training()`, entered by
`p4bench.engine.training` and the clipping paths); evaluation, distillation targets and
any other forward see the identity, as `model.eval()` would give.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

__all__ = ["training", "in_training", "computes_training_gradients", "hashed_dropout"]

F = TypeVar("F", bound=Callable[..., Any])

_TRAINING: ContextVar[bool] = ContextVar("p4bench_training", default=False)
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # odd multipliers (below 2^32: products stay below 2^63 in int64)
_MIX = 0x45D9F3B


@contextlib.contextmanager
def training() -> Iterator[None]:
    """Inside: forwards are training forwards (dropout on)."""
    token = _TRAINING.set(True)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def computes_training_gradients(function: F) -> F:
    """Decorator: `function` runs inside `training()`."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with training():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def in_training() -> bool:
    """Whether the current forward computes training gradients."""
    return _TRAINING.get()


def _mix(value: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), in int64 without overflow."""
    value = value ^ (value >> 16)
    value = (value * _MIX) & _MASK32
    value = value ^ (value >> 16)
    value = (value * _MIX) & _MASK32
    return value ^ (value >> 16)


def _fold(values: torch.Tensor, scale: float) -> torch.Tensor:
    """(b, n) floats -> (b,) 32-bit keys: each value quantised to a multiple of 1 / `scale`
    (a power of two: exact, the same on every device), its low 16 bits weighted by an odd
    multiplier of its position, summed."""
    quantised = (values.detach().clamp(-1e6, 1e6) * scale).round().to(torch.int64) & 0xFFFF
    count = values.shape[-1]
    weights = (torch.arange(count, device=values.device, dtype=torch.int64) * _GOLDEN + 1) & 0xFFFF
    return _mix((quantised * weights).sum(dim=-1) & _MASK32)


def hashed_dropout(
    h: torch.Tensor, x: torch.Tensor, salt_from: torch.Tensor, p: float, layer: int
) -> torch.Tensor:
    """`h` (b, ...) with each unit dropped with probability p and the rest scaled by
    1 / (1 - p), the mask hashed from the examples `x` (b, ...), the parameter tensor
    `salt_from` and the layer's number; `h` unchanged outside `training()` or at p = 0."""
    if not in_training() or p <= 0:
        return h
    examples = _fold(x.reshape(x.shape[0], -1), 2.0**12)
    salt = _fold(
        salt_from.reshape(1, -1), 2.0**24
    )  # fine: a step's smallest change to the parameters moves it
    units = torch.arange(h[0].numel(), device=h.device, dtype=torch.int64)
    seed = _mix((examples ^ salt ^ (layer * _GOLDEN & _MASK32)) & _MASK32)
    keys = _mix((seed.unsqueeze(1) + units.unsqueeze(0) * _GOLDEN) & _MASK32)  # (b, units)
    keep = (keys.to(torch.float64) / 2.0**32 >= p).reshape(h.shape)
    return h * keep.to(h.dtype) / (1.0 - p)
