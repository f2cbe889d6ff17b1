"""Krum and m-Krum (Blanchard et al. 2017), batched over aggregation points.

Score of update i: the sum of squared L2 distances to its n - f - 2 nearest other
updates; m-Krum keeps the m lowest-scoring updates (m = n - f by default) and averages
them; Krum keeps one. f is the number of Byzantine updates the defender assumes:
floor(assumed_fraction * n), option `assumed_fraction` (default 0.3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from p4bench.engine import Defense
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig

ASSUMED_FRACTION = Option(
    "assumed_fraction",
    float,
    0.3,
    "share f/n of Byzantine updates the defender plans for "
    "(the paper's share of malicious clients)",
    low=0,
    high=0.5,
    high_open=True,
)


def squared_distances(updates: torch.Tensor) -> torch.Tensor:
    """(B, n, n) squared L2 distances between the updates of each row (float64)."""
    return torch.cdist(updates.double(), updates.double()).pow(2)


def krum_scores_from(distances: torch.Tensor, mask: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """(B, n) Krum scores among the updates marked in `mask`: the sum of squared
    distances to the n - f - 2 nearest other marked updates (at least 1, at most n - 1);
    unmarked entries score +inf, and so does any update with a non-finite distance among
    its nearest (a NaN or overflowed distance is as far as can be: it ranks last, never best)."""
    count = distances.shape[1]
    eye = torch.eye(count, dtype=torch.bool, device=mask.device)
    invalid = ~(mask.unsqueeze(1) & mask.unsqueeze(2)) | eye
    far = torch.where(torch.isnan(distances), float("inf"), distances)  # NaN would sort after inf
    nearest = torch.sort(far.masked_fill(invalid, float("inf")), dim=2).values
    n = mask.sum(dim=1)
    neighbours = (n - f - 2).clamp_min(1).clamp_max((n - 1).clamp_min(1))
    # slots past a row's n - 1 real neighbours hold padding (+inf); reached only when n = 1,
    # where the lone update's score must stay finite. Real infinite distances stay +inf.
    real = torch.arange(count, device=mask.device).view(1, 1, -1) < (n - 1).view(-1, 1, 1)
    cumulative = torch.cumsum(torch.where(real, nearest, 0.0), dim=2)
    index = (neighbours - 1).clamp_min(0).view(-1, 1, 1).expand(-1, count, 1)
    scores = cumulative.gather(2, index).squeeze(2)
    return scores.masked_fill(~mask, float("inf"))


def krum_scores(updates: torch.Tensor, mask: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """(B, n) Krum scores; padded entries score +inf."""
    return krum_scores_from(squared_distances(updates), mask, f)


def assumed_fraction(config: RunConfig) -> float:
    """Option `assumed_fraction` (default 0.3, the paper's share of malicious clients)."""
    fraction: float = ASSUMED_FRACTION.resolve(
        config.options.get("assumed_fraction"), "options.assumed_fraction"
    )
    return fraction


def assumed_byzantine(config: RunConfig, n: torch.Tensor) -> torch.Tensor:
    """(B,) f = floor(assumed_fraction * n): Byzantine updates the defender plans for."""
    return torch.floor(assumed_fraction(config) * n.double()).long()


def lowest(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: the `keep[b]` lowest scores of each row (ties: first come first)."""
    rank = torch.argsort(torch.argsort(scores, dim=1, stable=True), dim=1)
    return rank < keep.unsqueeze(1)


class MultiKrum(Defense):
    """Keep the m updates with the lowest Krum scores (option `krum_m`, default n - f)."""

    name = "m-krum"
    description = "m-Krum: average the m updates closest to their n-f-2 nearest neighbours"
    options: ClassVar[tuple[Option, ...]] = (
        ASSUMED_FRACTION,
        Option("krum_m", int, None, "m, the updates kept; default: n - f", low=1),
    )

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.m: int | None = self.option_values.get("krum_m")  # Krum declares no krum_m

    def keep_count(self, n: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if self.m is None:
            return (n - f).clamp_min(1)
        return torch.minimum(torch.full_like(n, self.m), n)

    def select(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> torch.Tensor:
        n = mask.sum(dim=1)
        f = assumed_byzantine(self.config, n)
        return lowest(krum_scores(updates, mask, f), self.keep_count(n, f)) & mask


class Krum(MultiKrum):
    """Keep the single update with the lowest Krum score."""

    name = "krum"
    description = "Krum: keep the one update closest to its n-f-2 nearest neighbours"
    options = (ASSUMED_FRACTION,)

    def keep_count(self, n: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(n)


__all__ = [
    "Krum",
    "MultiKrum",
    "krum_scores",
    "krum_scores_from",
    "squared_distances",
    "lowest",
    "assumed_byzantine",
    "ASSUMED_FRACTION",
]
