"""Coordinate-wise median (Yin et al. 2018), batched over aggregation points.

Each coordinate of the aggregate is the median of that coordinate over the received
updates; with an even count it is the mean of the two middle values (FedSecurity's
`torch.median` takes the lower one). Unweighted: sample counts do not enter, as in the
robust-statistics definition. Drops no update as such.
"""

from __future__ import annotations

import torch

from p4bench.engine import Defense
from p4bench_defenses._common import gather_rank, sorted_coordinates


def coordinate_median(updates: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, P) coordinate-wise median of the real updates of each row (float64)."""
    values, count = sorted_coordinates(updates, mask)
    low, high = gather_rank(values, (count - 1) // 2), gather_rank(values, count // 2)
    return (low + high) / 2


class Median(Defense):
    """Aggregate = coordinate-wise median of the received updates."""

    name = "median"
    description = (
        "coordinate-wise median of the received updates (mean of the middle two when even)"
    )
    filters = False

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return coordinate_median(updates, mask).to(updates.dtype), mask.clone()
