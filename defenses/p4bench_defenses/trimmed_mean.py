"""Coordinate-wise trimmed mean (Yin et al. 2018), batched over aggregation points.

For every coordinate separately, the b largest and b smallest received values are
dropped and the rest averaged (unlike FedSecurity's `trimmed_mean`, which drops whole
clients ranked by sample count). b = floor(trim_fraction * n) with option
`trim_fraction`, default the assumed Byzantine share (`assumed_fraction`, 0.3), as in
ByzFL's and fedlib's TrMean (drop f on each side); b is capped so one value remains.
Unweighted. Drops no update as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.options import Option
from p4bench_defenses._common import sorted_coordinates
from p4bench_defenses.krum import ASSUMED_FRACTION

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def trimmed_mean(updates: torch.Tensor, mask: torch.Tensor, trim: torch.Tensor) -> torch.Tensor:
    """(B, P) mean of each coordinate after dropping its `trim[b]` largest and smallest values."""
    values, count = sorted_coordinates(updates, mask)
    trim = torch.minimum(trim, (count - 1).clamp_min(0) // 2)
    rank = torch.arange(values.shape[1]).unsqueeze(0)
    inside = (rank >= trim.unsqueeze(1)) & (rank < (count - trim).unsqueeze(1))  # (B, n)
    kept = torch.where(inside.unsqueeze(-1), values, torch.zeros_like(values)).sum(1)
    return kept / inside.sum(1, keepdim=True).clamp_min(1).double()


class TrimmedMean(Defense):
    """Aggregate = coordinate-wise mean after trimming b extremes on each side."""

    name = "trimmed-mean"
    description = (
        "coordinate-wise trimmed mean: per coordinate drop the b largest and b smallest values"
    )
    options = (
        Option(
            "trim_fraction",
            float,
            None,
            "b/n, the share trimmed on each side; default: assumed_fraction",
            low=0,
            high=0.5,
            high_open=True,
        ),
        ASSUMED_FRACTION,
    )
    filters = False

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        given = self.option_values["trim_fraction"]
        self.fraction: float = (
            given if given is not None else self.option_values["assumed_fraction"]
        )

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        trim = torch.floor(self.fraction * mask.sum(1).double()).long()
        return trimmed_mean(updates, mask, trim).to(updates.dtype), mask.clone()
