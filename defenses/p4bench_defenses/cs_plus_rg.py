"""CS+-RG (Gaucher et al., ICML 2025, "Unified breakdown analysis for Byzantine robust
gossip"): robust gossip (RG) with the clipped sum CS+ as its robust summand, batched over
receivers.

What is implemented, following the authors' code (renaudgaucher/Byzantine-Robust-Gossip,
`aggregators/robust_gossip.py`, `cs_plus` inside `make_defense`):

    x_i <- x_i - eta sum_j w_ij clip(x_i - x_j, tau_i),   clip(v, t) = v min(1, t / ||v||)

- w_ij: the weights the method mixes with, normalised over the vectors that arrived (W_ii
  included; its difference is 0), and eta = 1: with no clipping this is the method's plain
  W-weighted gossip mix. (The paper writes the step with Laplacian weights and
  eta = 1 / mu_max(L); for a row-stochastic W, eta = 1 is the same standard gossip step.)
- tau_i: sort the differences by norm (the own one, 0, included) with their weights; tau_i
  is the largest norm whose cumulative weight is at most total - 2 delta_i, so the largest
  differences holding weight at least 2 delta_i are clipped. delta_i = b w_max, the weight
  b Byzantine neighbours can hold (the authors' code: b times the Byzantine neighbours'
  weight). With equal weights: the 2b largest differences are clipped, to the (2b+1)-th
  largest norm. None left within (2b >= the neighbours): tau_i = 0, the receiver does not
  move; b = 0: no clipping.
- b: the Byzantine neighbours the receiver plans for: option `byzantine_neighbours`,
  default ceil(assumed_fraction * its neighbours).

Where descriptions differ: issue #47 describes CS+ as clipping the b largest neighbour
differences; the authors' code clips the largest ones holding twice the Byzantine weight
(`target_weight = total_weight - 2 * byz_weights`), 2b with equal weights. The default is
the code's 2b; option `cs_plus_clipped = b` clips the b largest instead (the count of
ClippedGossip's quantile rule, a weaker filter). Ties at the threshold are not clipped
(clipping a difference to its own norm changes nothing).

The receiver's own model is the vector it sent itself (sender = receiver), as in DP-DSGD,
DP-DSGT and Muffliato; without one the centre is the coordinate-wise median of what
arrived. Privacy: with DP on the rule sees only released (noised) models, so it is
post-processing and costs no privacy; the noise inflates honest differences, and tau
with them. Drops no update as such.
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
)

if TYPE_CHECKING:
    from p4bench.config import RunConfig

TWICE_B, ONCE_B = "2b", "b"


class CSPlusRG(Defense):
    """x_i - sum_j w_ij clip(x_i - x_j, tau_i), tau_i leaving the 2b largest differences clipped."""

    name = "cs-plus-rg"
    description = (
        "CS+-RG (Gaucher et al. 2025): robust gossip with clipped sums, "
        "the 2b largest neighbour differences clipped (b Byzantine neighbours declared)"
    )
    options = (
        Option(
            "cs_plus_clipped",
            str,
            TWICE_B,
            "how many of the largest differences cs-plus-rg clips: 2b (the authors' code) or b",
            choices=(TWICE_B, ONCE_B),
        ),
        *GOSSIP_OPTIONS,
    )
    filters = False
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.factor = 2.0 if self.option_values["cs_plus_clipped"] == TWICE_B else 1.0

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        own = own_slots(mask, identities)
        centre = centres(updates, mask, own)
        b = declared_byzantine(self.option_values, (mask & ~own).sum(dim=1))
        mass = self.factor * byzantine_mass(weights, mask, own, b)
        tau = radius_clipping_mass(distances_to(updates, centre), weights, mask, mass)
        mixed = clipped_gossip_step(updates, weights, mask, centre, tau)
        return mixed.to(updates.dtype), mask.clone()


__all__ = ["CSPlusRG"]
