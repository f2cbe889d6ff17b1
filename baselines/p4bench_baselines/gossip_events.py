"""The network-DP declarations of the gossip baselines (`Method.network_events`).

Each exchange declares the `Release`s that entered the nodes' states since the previous
exchange and then the exchange's `Gossip`: the matrix each receiver's mix applies to the
models it receives (`mix_through_aggregator` without a defense: the W-weighted mean of the
received ``update.*`` models, its own included). A release's noise multiplier and Poisson
rate are left NaN: the run's mechanism sets them (`p4bench.privacy.network_record`).

What is not declared (network DP "not applicable"): a run with a defense (its aggregator
is not a fixed linear mixture), DP-DSGT (each node holds two coupled states, model and
tracker, and its tracker adds differences of releases, g_t - g_{t-1}: neither fits a
single state per node with fresh releases), Muffliato's Chebyshev gossip (each step reads
the node's state two steps back, x^{k-1}, which no mixing of the current states gives).
"""

from __future__ import annotations

import math

import numpy as np

from p4bench.config import RunConfig
from p4bench.privacy.network_events import Gossip, NetworkEvent, Release

__all__ = ["defense_reason", "release_and_gossip"]


def defense_reason(config: RunConfig) -> str | None:
    """Why a defense rules the declaration out (None: the run has none)."""
    if config.defense not in (None, "none"):
        return f"defense '{config.defense}' aggregates the models nonlinearly"
    return None


def release_and_gossip(
    weights: np.ndarray, release_before: bool, release_after: bool = False
) -> list[NetworkEvent]:
    """[Release of every node]? + [Gossip(weights)] + [Release of every node]?, rows of
    `weights` normalized as the mix normalizes them (by the weight it received)."""
    matrix = np.asarray(weights, dtype=np.float64)
    matrix = matrix / matrix.sum(axis=1, keepdims=True)
    everyone = Release(np.ones(len(matrix), dtype=bool), math.nan, math.nan)
    return (
        ([everyone] if release_before else [])
        + [Gossip(matrix)]
        + ([everyone] if release_after else [])
    )
