"""P4L's per-round counters and the figures derived from them.

Peers count events (`Peer.stats`); each round the counters are added to the round's
metrics as `p4l.<name>`. They are sums, so the device launcher can add them over peer
processes; ratios (completion rate, retries per synergy, wasted share, bytes and
seconds per hop) are derived from the sums (`derived_metrics`), per round and for the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

PREFIX = "p4l."


class _Counted(Protocol):
    stats: dict[str, float]  # a Counter


def flush_stats(
    metrics: dict[str, float],
    peers: Iterable[_Counted],
    accepted: torch.Tensor,
    refused: torch.Tensor,
) -> None:
    """Add every peer's counters (then reset) and the gate's decisions to `metrics`."""
    for peer in peers:
        for key, value in peer.stats.items():
            metrics[PREFIX + key] = metrics.get(PREFIX + key, 0.0) + float(value)
        peer.stats.clear()
    metrics[PREFIX + "accepted"] = metrics.get(PREFIX + "accepted", 0.0) + float(accepted.sum())
    metrics[PREFIX + "refused"] = metrics.get(PREFIX + "refused", 0.0) + float(refused.sum())
    metrics.update(derived_metrics(metrics))


def derived_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Ratios from the summed counters (absent when their denominator is 0)."""

    def get(name: str) -> float:
        return float(totals.get(PREFIX + name, 0.0))

    out: dict[str, float] = {}
    pairs = {
        "completion_rate": ("completed", "synergies"),
        "retries_per_synergy": ("retries", "synergies"),
        "wasted_fraction": ("wasted_crypto_s", "crypto_s"),
        "bytes_per_hop": ("hop_bytes", "hops"),
        "crypto_s_per_hop": ("hop_crypto_s", "hops"),
        "transfer_s_per_hop": ("hop_transfer_s", "hops"),
        "members_per_synergy": ("members", "completed"),
    }
    for name, (numerator, denominator) in pairs.items():
        if get(denominator) > 0:
            out[PREFIX + name] = get(numerator) / get(denominator)
    return out
