"""Phase 1's DP steps with the batches gathered a chunk of clients at a time.

A DP step gathers every client's batch (C, b, d) before clipping: 1.6 GB on the
CIFAR-shaped bench, more than the models it trains. The clipped sums are per client, so
they are computed here over chunks of clients, each chunk's batch gathered, clipped and
dropped before the next; then the noise, the ledger and the budget see the whole round
in one release, exactly as `DPMechanism.step` does (same sums, same draws, same entries).

Not chunked (the caller takes the one-shot path): a run checked for record isolation
(its tape records one clean sum per release) and batches small enough to gather at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine.training import PerExampleLoss, gather_batch, logits_of
from p4bench.models import Params
from p4bench.privacy.clipping import clipped_gradient_sum
from p4bench.privacy.isolation import current_changed

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.method import StepContext

__all__ = ["BATCH_CHUNK_BYTES", "batch_chunks", "chunked_dp_gradient"]

# gathered samples at once: small beside the data, large enough that a chunk's GEMMs
# are not dominated by per-call overhead (tens of clients on CIFAR-shaped features)
BATCH_CHUNK_BYTES = 32 << 20


def batch_chunks(
    train: ClientTensors, index: torch.Tensor, budget: int | None = None
) -> list[slice]:
    """Client slices whose gathered batches (index (C, b)) take about `budget` bytes each
    (default `BATCH_CHUNK_BYTES`, read at the call)."""
    budget = BATCH_CHUNK_BYTES if budget is None else budget
    count = len(index)
    per_client = index.shape[1] * train.x[0, 0].numel() * train.x.element_size() if count else 0
    size = max(1, budget // max(per_client, 1))
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def chunkable(ctx: StepContext, chunks: list[slice], train: ClientTensors) -> bool:
    """Whether the chunked step applies: DP on, more than one chunk, samples in the
    same memory as the batch indices, and no record-isolation tape."""
    return (
        ctx.dp is not None
        and len(chunks) > 1
        and train.x.device == train.n.device
        and current_changed() is None
    )


def chunked_dp_gradient(
    ctx: StepContext,
    params: Params,
    train: ClientTensors,
    index: torch.Tensor,
    mask: torch.Tensor,
    loss: PerExampleLoss,
    teacher: Params | None,
    stats: torch.Tensor | None,
    chunks: list[slice],
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """`batch_gradient` through `ctx.dp` (noisy mean gradient, loss (C,) float64, released
    (C,) float), the clipped sums computed over `chunks` of clients."""
    assert ctx.dp is not None  # `chunkable` checked it
    weights = mask.float()
    summed: Params = {}  # each chunk's clipped sums written into place: no second copy
    losses: list[torch.Tensor] = []
    for part in chunks:
        owners = torch.arange(part.start, part.stop, device=index.device)
        x = gather_batch(train.x, index[part], clients=owners)
        chunk_params = {k: v[part] for k, v in params.items()}
        aux = (
            None
            if teacher is None
            else logits_of(ctx.model, {k: v[part] for k, v in teacher.items()}, x)
        )
        part_sums, part_losses = clipped_gradient_sum(
            ctx.model,
            chunk_params,
            x,
            gather_batch(train.y, index[part], clients=owners),
            weights[part],
            ctx.dp.settings.clip,
            loss,
            aux,
            None if stats is None else gather_batch(stats, index[part], clients=owners),
        )
        del x  # before the next chunk's gather
        for k, value in part_sums.items():
            if k not in summed:
                summed[k] = value.new_empty((len(index), *value.shape[1:]))
            summed[k][part] = value
        losses.append(part_losses)
    expected = ctx.config.data_rate * train.n.double()
    grads, released = ctx.dp.release(ctx, summed, ctx.config.data_rate, expected)
    per_example = torch.cat(losses)
    value = (per_example * weights).sum(1) / weights.sum(1).clamp_min(1)
    return grads, value.double(), released.float()
