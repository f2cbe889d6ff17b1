"""Bulyan (El Mhamdi, Guerraoui and Rouault, ICML 2018), batched over receivers.

1. Selection: theta = n - 2f updates chosen one by one by Krum, each time among the
   updates not yet chosen (scores over the remaining set).
2. Aggregation: per coordinate, the mean of the beta = theta - 2f chosen values closest
   to the coordinate-wise median of the chosen updates.
Bulyan needs n >= 4f + 3; f = floor(assumed_fraction * n) is lowered to
floor((n - 3) / 4) where a receiver gets too few updates (with 4 updates, f = 0 and
Bulyan is the plain mean). The updates left out in step 1 count as dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench_defenses._common import gather_rank, sorted_coordinates
from p4bench_defenses.krum import (
    ASSUMED_FRACTION,
    assumed_byzantine,
    krum_scores_from,
    squared_distances,
)

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def bulyan_f(config: RunConfig, n: torch.Tensor) -> torch.Tensor:
    """(B,) the f Bulyan can tolerate: the assumed share, capped by n >= 4f + 3."""
    return torch.minimum(assumed_byzantine(config, n), ((n - 3) // 4).clamp_min(0))


def iterative_krum(
    updates: torch.Tensor, mask: torch.Tensor, f: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """(B, n) bool: `count[b]` updates picked one at a time by Krum among those left."""
    distances = squared_distances(updates)
    chosen = torch.zeros_like(mask)
    for step in range(int(count.max()) if len(count) else 0):
        remaining = mask & ~chosen
        scores = krum_scores_from(distances, remaining, f)
        best = scores.argmin(dim=1)
        pick = (count > step) & remaining.any(dim=1)
        chosen[pick, best[pick]] = True
    return chosen


def closest_to_median_mean(
    updates: torch.Tensor, chosen: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """(B, P) per coordinate, the mean of the beta[b] chosen values closest to their median."""
    values, count = sorted_coordinates(updates, chosen)
    median = (gather_rank(values, (count - 1) // 2) + gather_rank(values, count // 2)) / 2
    gap = (
        (updates.double() - median.unsqueeze(1))
        .abs()
        .masked_fill(~chosen.unsqueeze(-1), float("inf"))
    )
    rank = torch.argsort(torch.argsort(gap, dim=1, stable=True), dim=1)
    inside = (rank < beta.view(-1, 1, 1)) & chosen.unsqueeze(-1)
    return (updates.double() * inside).sum(1) / inside.sum(1).clamp_min(1)


class Bulyan(Defense):
    """Krum-select theta = n - 2f updates, then average per coordinate the beta = theta - 2f closest to the median."""

    name = "bulyan"
    description = "Bulyan: iterated Krum selects n-2f updates, then a per-coordinate trimmed mean around the median"
    options = (ASSUMED_FRACTION,)

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = mask.sum(dim=1)
        f = bulyan_f(self.config, n)
        theta = (n - 2 * f).clamp_min(1)
        chosen = iterative_krum(updates, mask, f, theta) & mask
        beta = (theta - 2 * f).clamp_min(1)
        return closest_to_median_mean(updates, chosen, beta).to(updates.dtype), chosen
