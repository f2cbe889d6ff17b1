"""P4's exchanges over receivers in chunks: bounded memory for the recompute check.

With aggregator_check=recompute every member of a group receives every member's upload,
so the uploads gathered per message are group_size times the clients' proxies (1.3 GB
on the CIFAR-shaped bench, twice over with the vectors they are flattened into). The
messages themselves share one table row per sender (`Messages.rows`); here they are
gathered a chunk of whole receivers at a time, each receiver's aggregate computed as
before (same function, same receivers' inboxes), so only a chunk's copies are live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Messages

if TYPE_CHECKING:
    from p4bench.engine.threats import Aggregator

__all__ = ["EXCHANGE_CHUNK_BYTES", "aggregate_in_chunks", "receiver_chunks"]

# payload bytes gathered at once: the aggregation holds about twice this (the gathered
# payload and its flattened vectors), the recompute check's comparison about ten times
# (both sides flattened, their float64 copies and gaps)
EXCHANGE_CHUNK_BYTES = 16 << 20


def receiver_chunks(inbox: Messages, budget: int | None = None) -> list[torch.Tensor]:
    """Indices of `inbox` (sorted by destination) in chunks of whole receivers, each about
    `budget` bytes of gathered payload (default `EXCHANGE_CHUNK_BYTES`, read at the call;
    at least one receiver per chunk)."""
    budget = EXCHANGE_CHUNK_BYTES if budget is None else budget
    if not len(inbox):
        return []
    message_bytes = sum(v[0].numel() * v.element_size() for v in inbox.table.values() if len(v))
    per_chunk = max(1, budget // max(message_bytes, 1))
    _, counts = torch.unique_consecutive(inbox.dst, return_counts=True)
    chunks, start, end = [], 0, 0
    for size in counts.tolist():
        if end > start and end - start + size > per_chunk:
            chunks.append(torch.arange(start, end))
            start = end
        end += size
    chunks.append(torch.arange(start, end))
    return chunks


def aggregate_in_chunks(
    aggregator: Aggregator, inbox: Messages, round_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aggregator.aggregate_by_destination` with equal weights, over chunks of receivers:
    (dst (B,), aggregate (B, P)). A defense sees the whole round at once (its screen may
    count senders across receivers): then no chunks."""
    chunks = receiver_chunks(inbox)
    if aggregator.defense is not None or len(chunks) <= 1:
        return aggregator.aggregate_by_destination(
            inbox, torch.ones(len(inbox), dtype=torch.float64), round_index
        )
    parts = [
        aggregator.aggregate_by_destination(
            inbox.select(chunk), torch.ones(len(chunk), dtype=torch.float64), round_index
        )
        for chunk in chunks
    ]
    return torch.cat([dst for dst, _ in parts]), torch.cat([mean for _, mean in parts])
