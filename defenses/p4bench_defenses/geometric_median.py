"""Geometric median by the smoothed Weiszfeld algorithm (RFA, Pillutta et al. 2022).

z minimises sum_i w_i ||x_i - z|| over the received updates x_i with their weights w_i
(sample counts). Iterate z <- sum_i b_i x_i / sum_i b_i with b_i = w_i / max(nu, ||x_i - z||)
from the weighted mean, until z moves by less than `geomed_tolerance` (1e-6) times its
norm or after `geomed_iterations` (100) steps; nu = `geomed_nu` (1e-6) keeps the step
defined when z hits a data point. The whole update is one vector (FedSecurity's rfa works
per layer and pairs weights with clients through a Python set, which loses duplicates).
Drops no update as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def weiszfeld(
    updates: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    iterations: int = 100,
    nu: float = 1e-6,
    tolerance: float = 1e-6,
) -> torch.Tensor:
    """(B, P) weighted geometric median of the real updates of each row (float64)."""
    x = updates.double()
    w = (weights.double() * mask).clamp_min(0)
    w = torch.where(w.sum(1, keepdim=True) > 0, w, mask.double())  # all-zero weights: unweighted
    z = (w.unsqueeze(-1) * x).sum(1) / w.sum(1, keepdim=True).clamp_min(1e-300)
    for _ in range(iterations):
        distance = (x - z.unsqueeze(1)).norm(dim=2).clamp_min(nu)
        beta = w / distance
        new = (beta.unsqueeze(-1) * x).sum(1) / beta.sum(1, keepdim=True).clamp_min(1e-300)
        moved = (new - z).norm(dim=1)
        z = new
        if bool((moved <= tolerance * z.norm(dim=1).clamp_min(1e-12)).all()):
            break
    return z


class GeometricMedian(Defense):
    """Aggregate = weighted geometric median (smoothed Weiszfeld)."""

    name = "geometric-median"
    description = "geometric median of the updates by smoothed Weiszfeld iterations (RFA)"
    options = (
        Option("geomed_iterations", int, 100, "most Weiszfeld steps", low=1),
        Option(
            "geomed_nu",
            float,
            1e-6,
            "nu, the smallest distance a step divides by",
            low=0,
            low_open=True,
        ),
        Option(
            "geomed_tolerance", float, 1e-6, "stop when z moves by less than this times its norm"
        ),
    )
    filters = False

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        values = self.option_values
        self.iterations: int = values["geomed_iterations"]
        self.nu: float = values["geomed_nu"]
        self.tolerance: float = values["geomed_tolerance"]

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = weiszfeld(updates, weights, mask, self.iterations, self.nu, self.tolerance)
        return z.to(updates.dtype), mask.clone()
