"""TF32 matrix products, only outside the DP step (never in its norms or clipped sums).

TF32 multiplies float32 operands with 10-bit mantissas (relative error near 1e-3). A DP
step's per-example norms and clipped sums stay float32: a norm computed low could let an
example's clipped contribution exceed the clip, outside the ledger. Work outside that step
may use TF32, such as training a model that is never released (P4's private model): where
its outputs enter a DP loss (a teacher's logits), they are constants of the per-example
gradient, whose clipping bounds it whatever their values. On the CPU the flag has no effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["PRECISIONS", "tf32_matmuls"]

PRECISIONS = ("fp32", "tf32")


@contextlib.contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """Inside: CUDA float32 matrix products in TF32 where `enabled`; the previous setting
    is restored on the way out, also after an error."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before
