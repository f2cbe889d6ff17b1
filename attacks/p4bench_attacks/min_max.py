"""Min-max attack (Shejwalkar and Houmansadr, NDSS 2021, AGR-agnostic).

The attackers all send mu - gamma * p, with mu the mean of the honest updates their
receiver gets and p a perturbation direction (option `minmax_direction`: `std`, the
coordinate-wise standard deviation, default; `unit-vec`, mu / ||mu||; `sign`,
sign(mu)). gamma is the largest value for which the crafted update is no farther from
any honest update than the two farthest honest updates are from each other:
max_i ||mal - h_i|| <= max_ij ||h_i - h_j||, found with the paper's search (start at
`minmax_gamma` = 10, halve the step until it changes by less than 1e-5). Omniscient:
see `p4bench_attacks._honest` for what the attackers know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import HonestPools, honest_pools, send, update_dtype

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng

DIRECTIONS = ("std", "unit-vec", "sign")
_TOLERANCE = 1e-5


def min_max_gamma(
    pools: HonestPools, direction: torch.Tensor, start: float, tolerance: float = _TOLERANCE
) -> torch.Tensor:
    """(D,) the largest gamma with max_i ||mu - gamma p - h_i|| <= max_ij ||h_i - h_j||."""
    honest = pools.updates.double()
    pair = pools.mask.unsqueeze(1) & pools.mask.unsqueeze(2)
    threshold = torch.cdist(honest, honest).masked_fill(~pair, 0.0).amax(dim=(1, 2))
    mean = pools.mean()

    def fits(gamma: torch.Tensor) -> torch.Tensor:
        crafted = mean - gamma.unsqueeze(1) * direction
        # annotated: Tensor.norm is untyped
        distance: torch.Tensor = (
            (honest - crafted.unsqueeze(1)).norm(dim=2).masked_fill(~pools.mask, 0.0)
        )
        return distance.amax(dim=1) <= threshold

    rows = mean.shape[0]
    gamma = torch.full((rows,), float(start), dtype=torch.float64)
    step = gamma.clone()
    success = torch.zeros(rows, dtype=torch.float64)
    active = torch.ones(rows, dtype=torch.bool)
    while bool(active.any()):
        ok = fits(gamma)
        success = torch.where(active & ok, gamma, success)
        gamma = torch.where(active, torch.where(ok, gamma + step / 2, gamma - step / 2), gamma)
        step = torch.where(active, step / 2, step)
        active = active & ((success - gamma).abs() > tolerance)
    return success


class MinMax(Attack):
    """Send mean - gamma * direction, gamma maximal within the honest updates' spread."""

    name = "min-max"
    description = (
        "min-max (Shejwalkar & Houmansadr): mean - gamma*std with the largest gamma that stays "
        "within the honest spread"
    )
    options = Attack.options + (
        Option(
            "minmax_direction",
            str,
            "std",
            "perturbation direction p: coordinate-wise std, mu/||mu|| or sign(mu)",
            choices=DIRECTIONS,
        ),
        Option("minmax_gamma", float, 10.0, "gamma the search starts from", low=0, low_open=True),
    )
    omniscient = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.direction: str = self.option_values["minmax_direction"]
        self.start: float = self.option_values["minmax_gamma"]

    def perturbation(self, pools: HonestPools) -> torch.Tensor:
        """(D, P) the direction p of each pool."""
        mean = pools.mean()
        if self.direction == "std":
            return pools.std()
        if self.direction == "sign":
            return torch.sign(mean)
        norm: torch.Tensor = mean.norm(dim=1, keepdim=True)  # Tensor.norm is untyped
        return mean / norm.clamp_min(1e-12)

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        pools = honest_pools(messages, observed, colluding)
        direction = self.perturbation(pools)
        gamma = min_max_gamma(pools, direction, self.start)
        crafted = pools.mean() - gamma.unsqueeze(1) * direction
        return send(messages, crafted[pools.row].to(update_dtype(messages)))
