"""Helpers shared by the gossip defenses (clipped-gossip, cs-plus-rg, nna), batched over
receivers: which received vector is the receiver's own, how many Byzantine neighbours it
plans for, and the clipping radii that leave a given weight of the farthest neighbours
clipped.

A gossip defense is centred on the receiver's own model x_i: in DP-DSGD, DP-DSGT and
Muffliato the mixing row W_i includes W_ii, so x_i arrives in the receiver's own inbox
(sender = receiver). Where it does not (a method that does not mix its own model, or an
own model the screen dropped as non-finite), the centre is the coordinate-wise median of
what arrived: a robust stand-in, never the plain mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from p4bench.options import Option
from p4bench_defenses._common import receivers_or_default
from p4bench_defenses.krum import ASSUMED_FRACTION
from p4bench_defenses.median import coordinate_median

BYZANTINE_NEIGHBOURS = Option(
    "byzantine_neighbours",
    int,
    None,
    "b, the Byzantine neighbours each receiver plans for (gossip defenses); "
    "default: ceil(assumed_fraction * its neighbours)",
    low=0,
)
GOSSIP_OPTIONS = (BYZANTINE_NEIGHBOURS, ASSUMED_FRACTION)


def own_slots(mask: torch.Tensor, identities: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, n) bool: the receiver's own usable vector (its first, the screen keeps one per
    sender); all False in a row without one. Without identities (a direct call), ids are
    positional: row b's own vector is slot b."""
    receivers, senders = receivers_or_default(identities, mask)
    own = (senders == receivers.to(senders.device).unsqueeze(1)) & mask
    first = torch.cumsum(own.long(), dim=1) == 1
    return own & first


def centres(updates: torch.Tensor, mask: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """(B, P) float64: each receiver's own vector, else the coordinate-wise median of its
    usable vectors (zeros where it has none)."""
    x = updates.double()
    mine = (x * own.unsqueeze(-1)).sum(dim=1)
    if bool(own.any(dim=1).all()):  # the usual case: no median to compute
        return mine
    fallback = torch.nan_to_num(coordinate_median(x, mask), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(own.any(dim=1, keepdim=True), mine, fallback)


def declared_byzantine(values: Mapping[str, Any], neighbours: torch.Tensor) -> torch.Tensor:
    """(B,) b from a defense's resolved options: `byzantine_neighbours`, else
    ceil(assumed_fraction * neighbours) (a receiver that plans for a share f of Byzantine
    neighbours plans for at least one as soon as f > 0: on a ring floor(0.3 * 2) = 0 would
    switch every gossip defense off)."""
    given = values.get("byzantine_neighbours")
    if given is not None:
        return torch.full_like(neighbours, int(given))
    fraction = float(values["assumed_fraction"])
    # ceil with a tolerance: 0.3 * 10 is 3.0000000000000004 in floating point
    return torch.ceil(fraction * neighbours.double() - 1e-9).clamp_min(0).long()


def byzantine_mass(
    weights: torch.Tensor, mask: torch.Tensor, own: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """(B,) delta_i = b * the largest weight among the receiver's neighbours: the weight b
    Byzantine neighbours could hold at most (the receiver does not know which they are)."""
    neighbour = weights.double() * (mask & ~own)
    return b.double() * neighbour.max(dim=1).values


def distances_to(updates: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """(B, n) float64 L2 distances of each vector from its receiver's centre."""
    distances: torch.Tensor = (updates.double() - centre.unsqueeze(1)).norm(dim=2)
    return distances


def radius_clipping_mass(
    distances: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, mass: torch.Tensor
) -> torch.Tensor:
    """(B,) the clipping radius that clips the farthest vectors holding weight `mass`.

    Sorted by distance (own vector, at 0, included), tau is the largest distance whose
    cumulative weight is at most total - mass: every vector beyond it, at least `mass`
    of weight, is clipped (Gaucher et al.'s rule; with equal weights and mass = k w, the
    k farthest are clipped to the (k+1)-th farthest distance). 0 where nothing remains
    within (the receiver does not move); +inf where mass is 0 (plain gossip)."""
    w = weights.double() * mask
    far = distances.masked_fill(~mask, math.inf)
    order = torch.argsort(far, dim=1, stable=True)
    sorted_d, sorted_w = far.gather(1, order), w.gather(1, order)
    cumulative = torch.cumsum(sorted_w, dim=1)
    total = cumulative[:, -1:]
    within = (cumulative <= total - mass.unsqueeze(1) + 1e-9 * total) & mask.gather(1, order)
    tau = torch.where(within, sorted_d, -math.inf).max(dim=1).values
    tau = torch.where(within.any(dim=1), tau, torch.zeros_like(tau))
    return torch.where(mass > 0, tau, torch.full_like(tau, math.inf))


def theory_radius(
    distances: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, mass: torch.Tensor
) -> torch.Tensor:
    """(B,) He et al.'s Theorem III radius sqrt(sum_{j good} W_ij ||x_j - x_i||^2 / delta_i),
    the good set estimated as the vectors within `radius_clipping_mass` (all but the
    farthest weight delta_i); +inf where delta_i is 0 (plain gossip)."""
    cut = radius_clipping_mass(distances, weights, mask, mass)
    good = mask & (distances <= cut.unsqueeze(1))
    spread = (weights.double() * good * distances.pow(2)).sum(dim=1)
    tau = torch.sqrt(spread / mass.clamp_min(1e-300))
    return torch.where(mass > 0, tau, torch.full_like(tau, math.inf))


def clipped_gossip_step(
    updates: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    centre: torch.Tensor,
    tau: torch.Tensor,
) -> torch.Tensor:
    """(B, P) float64 x_i + sum_j s_ij clip(x_j - x_i, tau_i), s_i = the receiver's weights
    over its usable vectors normalised to sum 1, clip(v, t) = v min(1, t / ||v||). With
    tau = inf it is the weighted mean of the vectors, the plain gossip mix."""
    w = weights.double() * mask
    share = w / w.sum(dim=1, keepdim=True).clamp_min(1e-300)
    diff = updates.double() - centre.unsqueeze(1)
    norms = diff.norm(dim=2)
    scale = torch.clamp(tau.unsqueeze(1) / norms.clamp_min(1e-300), max=1.0)
    step = torch.bmm((share * scale).unsqueeze(1), diff).squeeze(1)
    return centre + step


__all__ = [
    "BYZANTINE_NEIGHBOURS",
    "GOSSIP_OPTIONS",
    "byzantine_mass",
    "centres",
    "clipped_gossip_step",
    "declared_byzantine",
    "distances_to",
    "own_slots",
    "radius_clipping_mass",
    "theory_radius",
]
