"""What a gossip run does, as the network-DP accountant sees it (`p4bench.privacy.network_dp`).

A run is a sequence of events on every node's state (a vector; the accounting is linear, so
it is done per coordinate):

- `Release`: each node in `nodes` adds a fresh noisy release to its state: its private
  contribution (one record of the node changes it by at most the sensitivity, in L2) plus
  Gaussian noise of standard deviation `noise_multiplier` x the sensitivity. With
  `sample_rate` q < 1 each record takes part in the release with probability q,
  independently (Poisson sampling, as in DP-SGD); the default 1 claims no sampling.
- `Gossip`: every node v receives, from every other node w with ``weights[v, w] != 0``,
  w's current state (that message is what v observes of w), then sets its state to
  ``sum_w weights[v, w] * state_w``.

Node v's view of the run is every message it receives. Methods describe their exchanges with
these events (`Method.network_events`), the run records them, and the accountant turns the
record into the pairwise privacy loss epsilon(u -> v).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Gossip", "NetworkEvent", "Release"]


@dataclass(frozen=True)
class Release:
    """Nodes `nodes` ((N,) bool) each add a fresh Gaussian release to their state."""

    nodes: np.ndarray
    noise_multiplier: float  # noise standard deviation / L2 sensitivity of one record
    sample_rate: float = 1.0  # Poisson rate of each record in the release; NaN: the run's


@dataclass(frozen=True)
class Gossip:
    """One mixing step: v receives w's state where ``weights[v, w] != 0`` (v != w), then
    its state becomes row v of ``weights @ states``."""

    weights: np.ndarray  # (N, N) float64


NetworkEvent = Release | Gossip
