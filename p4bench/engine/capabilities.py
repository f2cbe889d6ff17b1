"""`Capabilities`: what a method exposes, in a module of its own so that attacks and
defenses (`p4bench.engine.threats`) can check compatibility without importing the
method interface, which refers to them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What a method exposes, so attacks and defenses can check compatibility up front."""

    shares_individual_updates: bool = False  # receivers see single clients' updates
    has_aggregator: bool = False  # somebody averages updates (a server or a peer)
    personalized: bool = False  # each client deploys its own model (else a consensus model)
    uses_server: bool = False  # a central server node takes part in exchanges
    # updates travel only inside encrypted running sums (secure aggregation, e.g. P4L's
    # Paillier chains): nobody can inspect or filter a single client's update
    hides_individual_updates: bool = False
    # members take turns aggregating their group's updates and distributing the result
    # (P4's rotating aggregator): what a compromised aggregator can poison
    peer_aggregator: bool = False
