"""Nearest-neighbour averaging, NNA (Farhadkhani et al. 2023, "Robust collaborative
learning with linear gradient overhead", ICML; the NNA step of their MoNNA), batched over
receivers.

Each receiver i averages the n - f received vectors nearest to its own model x_i, its own
included (it is at distance 0): n counts the usable vectors it received (its own among
them) and f = b, the Byzantine neighbours it plans for (option `byzantine_neighbours`,
default ceil(assumed_fraction * its neighbours)); at least its own vector is kept. The
average is weighted by the method's mixing weights W_ij, renormalised over the kept
vectors: with f = 0 it is exactly the method's plain W-weighted mix, and with equal
weights (the paper's complete graph) it is the paper's unweighted mean. A Byzantine
vector enters only if it is nearer to x_i than an honest one, so one far vector moves x_i
by nothing, and one kept moves it by at most the distance of the farthest honest vector
kept.

Option `nna_variant`:

- ``own`` (default): the paper's NNA above, centred on the receiver's own model.
- ``each``: nearest-neighbour mixing (NNM, Allouah et al. 2023, "Fixing by mixing"):
  every received vector is replaced by the unweighted mean of its own n - f nearest
  received vectors, then the W-weighted mean of the replaced vectors is taken. This is
  the pre-aggregation step of that paper, meant to be followed by a robust rule; followed
  by a plain mean, as here, one far vector still moves the receiver by about its
  distance / (n - f) (its own replacement includes itself), so it is not bounded as
  ``own`` is. Nothing is dropped in this variant (`kept` is every usable vector).

The receiver's own model is the vector it sent itself (sender = receiver), as in DP-DSGD,
DP-DSGT and Muffliato; without one the centre is the coordinate-wise median of what
arrived. Privacy: with DP on the rule sees only released (noised) models, so it is
post-processing and costs no privacy. In ``own`` the vectors not among the n - f nearest
are reported dropped (detection precision and recall apply).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.engine.threats import weighted_mean
from p4bench.options import Option
from p4bench_defenses._gossip import (
    GOSSIP_OPTIONS,
    centres,
    declared_byzantine,
    distances_to,
    own_slots,
)
from p4bench_defenses.krum import lowest

if TYPE_CHECKING:
    from p4bench.config import RunConfig

OWN, EACH = "own", "each"


def nearest_to_each(updates: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, n, P) float64: each vector replaced by the mean of its `keep[b]` nearest usable
    vectors of the same row (itself included); padded slots stay as they are."""
    x = updates.double()
    distances = torch.cdist(x, x)
    far = distances.masked_fill(~mask.unsqueeze(1), float("inf"))
    rank = torch.argsort(torch.argsort(far, dim=2, stable=True), dim=2)
    chosen = (rank < keep.view(-1, 1, 1)) & mask.unsqueeze(1)
    share = chosen.double() / chosen.sum(dim=2, keepdim=True).clamp_min(1)
    return torch.where(mask.unsqueeze(-1), torch.bmm(share, x), x)


class NearestNeighbourAveraging(Defense):
    """W-weighted mean of the n - f received vectors nearest to the receiver's own."""

    name = "nna"
    description = (
        "nearest-neighbour averaging (Farhadkhani et al. 2023): the W-weighted mean of the "
        "n - f received models nearest to the receiver's own"
    )
    options = (
        Option(
            "nna_variant",
            str,
            OWN,
            "own: average the n - f nearest to the receiver's own model (NNA); each: replace "
            "every vector by the mean of its n - f nearest, then mix (NNM, not bounded alone)",
            choices=(OWN, EACH),
        ),
        *GOSSIP_OPTIONS,
    )
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.variant: str = self.option_values["nna_variant"]

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        own = own_slots(mask, identities)
        count = mask.sum(dim=1)
        f = declared_byzantine(self.option_values, (mask & ~own).sum(dim=1))
        keep = (count - f).clamp_min(1)
        w = weights.double() * mask
        if self.variant == EACH:
            mixed = weighted_mean(nearest_to_each(updates, mask, keep), w)
            return mixed.to(updates.dtype), mask.clone()
        distances = distances_to(updates, centres(updates, mask, own))
        # the own vector first among equals (a copy of it at distance 0 ties with it)
        far = torch.where(own, -1.0, distances.masked_fill(~mask, float("inf")))
        kept = lowest(far, keep) & mask
        mixed = weighted_mean(updates.double(), w * kept)
        return mixed.to(updates.dtype), kept


__all__ = ["NearestNeighbourAveraging", "nearest_to_each"]
