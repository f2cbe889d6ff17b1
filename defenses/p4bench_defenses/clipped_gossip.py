"""ClippedGossip (He, Karimireddy and Jaggi 2022, "Byzantine-robust decentralized learning
via ClippedGossip", arXiv 2202.01545; the authors call it self-centered clipping, SSClip),
batched over receivers.

Each receiver i moves from its own model by the clipped differences to what it received:

    x_i <- x_i + sum_j W_ij clip(x_j - x_i, tau_i),   clip(v, t) = v min(1, t / ||v||)

with W_ij the weights the method mixes with (normalised over the vectors that arrived,
W_ii included, so with tau_i = inf this is exactly the method's plain W-weighted mix).
A Byzantine neighbour moves x_i by at most W_ij tau_i, whatever it sends.

Clipping radius (option `clipped_gossip_tau` for a fixed one; otherwise adaptive, option
`clipped_gossip_rule`):

- ``quantile`` (default; the authors' code, `SelfCenteredClipping` with no tau): tau_i is
  the distance that leaves the b farthest neighbours clipped, i.e. the (b+1)-th largest
  neighbour distance (their code hard-codes b = 1: the second-largest). With unequal
  weights: the farthest neighbours holding weight delta_i = b max_j W_ij are clipped.
- ``theory``: the radius of the paper's Theorem III,
  tau_i = sqrt(sum_{j good} W_ij ||x_j - x_i||^2 / delta_i), the good set estimated as
  all but the farthest weight delta_i (as Gaucher et al.'s `CShe_RG` estimates it).

b is the number of Byzantine neighbours the receiver plans for: option
`byzantine_neighbours`, default ceil(assumed_fraction * its neighbours). b = 0 is plain
gossip. The receiver's own model is the vector it sent itself (sender = receiver), as in
DP-DSGD, DP-DSGT and Muffliato, whose W has a diagonal; without one the centre is the
coordinate-wise median of what arrived (`_gossip.centres`).

Privacy: with DP on, the receiver sees only released (noised) models; the rule reads
nothing else, so it is post-processing and costs no privacy. The noise adds to every
honest distance, so adaptive radii grow with it. Drops no update as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.options import Option
from p4bench_defenses._gossip import (
    GOSSIP_OPTIONS,
    byzantine_mass,
    centres,
    clipped_gossip_step,
    declared_byzantine,
    distances_to,
    own_slots,
    radius_clipping_mass,
    theory_radius,
)

if TYPE_CHECKING:
    from p4bench.config import RunConfig

QUANTILE, THEORY = "quantile", "theory"


class ClippedGossip(Defense):
    """x_i + sum_j W_ij clip(x_j - x_i, tau_i), tau_i adaptive (b farthest clipped) or fixed."""

    name = "clipped-gossip"
    description = (
        "ClippedGossip (He et al. 2022): move from the own model by the W-weighted "
        "differences clipped to tau (default: the b farthest neighbours clipped)"
    )
    options = (
        Option(
            "clipped_gossip_tau",
            float,
            None,
            "clipped-gossip's fixed radius tau; default: adaptive (clipped_gossip_rule)",
            low=0,
            low_open=True,
        ),
        Option(
            "clipped_gossip_rule",
            str,
            QUANTILE,
            "adaptive tau: quantile (the b farthest neighbours clipped, the authors' code) or "
            "theory (sqrt of the good neighbours' weighted squared distances / delta, Thm III)",
            choices=(QUANTILE, THEORY),
        ),
        *GOSSIP_OPTIONS,
    )
    filters = False
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.tau: float | None = self.option_values["clipped_gossip_tau"]
        self.rule: str = self.option_values["clipped_gossip_rule"]

    def radius(
        self, distances: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, own: torch.Tensor
    ) -> torch.Tensor:
        """(B,) tau_i of each receiver."""
        if self.tau is not None:
            return torch.full((mask.shape[0],), self.tau, dtype=torch.float64)
        neighbours = (mask & ~own).sum(dim=1)
        mass = byzantine_mass(
            weights, mask, own, declared_byzantine(self.option_values, neighbours)
        )
        if self.rule == THEORY:
            return theory_radius(distances, weights, mask, mass)
        return radius_clipping_mass(distances, weights, mask, mass)

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        own = own_slots(mask, identities)
        centre = centres(updates, mask, own)
        tau = self.radius(distances_to(updates, centre), weights, mask, own)
        mixed = clipped_gossip_step(updates, weights, mask, centre, tau)
        return mixed.to(updates.dtype), mask.clone()


__all__ = ["ClippedGossip"]
