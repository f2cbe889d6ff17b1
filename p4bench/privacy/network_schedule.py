"""The network-DP events of a gossip method on a topology, outside a run.

`p4bench privacy network` accounts a method's schedule without training: the topology's
graph of every round (drawn as runs draw it, from the same public streams of the seed),
its mixing matrix, and the order in which the method releases and gossips:

- ``muffliato``: per round one noisy step (a `Release` of every node) then K gossip steps
  with the round's W (a run with ``-o iterations=1 -o gossip_steps=K``);
- ``dp-dsgd`` (combine-then-adapt, the suite's default order, and D-PSGD alike): per round
  one gossip step, then the noisy step; the messages of a round carry the releases of the
  earlier rounds, so the last release is never sent.

Local DP of the same schedule (what a direct receiver of every release learns) comes from
the ``pld`` accountant: full-batch Gaussian releases, one per round, at the same sigma.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from p4bench.errors import ConfigError, IncompatibleError
from p4bench.privacy.network_events import Gossip, NetworkEvent, Release

__all__ = [
    "METHODS",
    "MIXINGS",
    "NetworkSchedule",
    "build_schedule",
    "local_epsilon",
    "noise_for_local_epsilon",
]

METHODS = ("muffliato", "dp-dsgd")
MIXINGS = ("metropolis", "uniform")


@dataclass(frozen=True)
class NetworkSchedule:
    """A method's events on a topology, and the graph they run on.

    Attributes:
        events: the `Release` and `Gossip` events, in order.
        adjacency: (N, N) union over rounds of the graph's edges (``A[i, j]``: i sends to j).
        releases: noisy releases of each node (for its local DP).
        gossip_steps: gossip steps per round.
        description: one line saying what was built.
    """

    events: tuple[NetworkEvent, ...]
    adjacency: np.ndarray
    releases: int
    gossip_steps: int
    description: str


def _mixing(adjacency: np.ndarray, mixing: str) -> np.ndarray:
    from p4bench.topology.mixing import metropolis_hastings, uniform_averaging

    if mixing == "metropolis":
        try:
            return metropolis_hastings(adjacency)
        except IncompatibleError:
            raise IncompatibleError(
                "metropolis mixing needs an undirected graph; use --mixing uniform for this topology"
            ) from None
    return uniform_averaging(adjacency)


def _graphs(
    topology: str, clients: int, rounds: int, seed: int, options: dict[str, object] | None
) -> list[np.ndarray]:
    from p4bench.engine.method_kit import GraphSchedule

    schedule = GraphSchedule(topology, options or {}, clients, seed)
    if not schedule.time_varying:
        return [schedule.adjacency(0)] * rounds
    return [schedule.adjacency(r) for r in range(rounds)]


def build_schedule(
    *,
    method: str,
    topology: str,
    clients: int,
    rounds: int,
    noise_multiplier: float,
    gossip_steps: int | None = None,
    mixing: str = "metropolis",
    seed: int = 0,
    topology_options: dict[str, object] | None = None,
    sample_rate: float = 1.0,
) -> NetworkSchedule:
    """The events of `rounds` rounds of `method` on `topology` with `clients` nodes; each
    release samples every record with probability `sample_rate` (Poisson; 1: full batch)."""
    if method not in METHODS:
        raise ConfigError("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if mixing not in MIXINGS:
        raise ConfigError("mixing", f"must be one of {', '.join(MIXINGS)}, got {mixing!r}")
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 1:
        raise ConfigError("rounds", f"must be an integer >= 1, got {rounds}")
    if not (np.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ConfigError(
            "noise-multiplier", f"must be a finite number > 0, got {noise_multiplier}"
        )
    if not 0.0 < sample_rate <= 1.0:
        raise ConfigError("data-rate", f"must be in (0, 1], got {sample_rate}")
    if method == "dp-dsgd" and gossip_steps not in (None, 1):
        raise ConfigError("gossip-steps", f"dp-dsgd gossips once per round, got {gossip_steps}")
    steps = 1 if gossip_steps is None else gossip_steps
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ConfigError("gossip-steps", f"must be an integer >= 0, got {steps}")
    graphs = _graphs(topology, clients, rounds, seed, topology_options)
    everyone = np.ones(clients, dtype=bool)
    release = Release(everyone, float(noise_multiplier), float(sample_rate))
    events: list[NetworkEvent] = []
    for adjacency in graphs:
        weights = _mixing(adjacency, mixing)
        if method == "muffliato":
            events += [release] + [Gossip(weights=weights)] * int(steps)
        else:  # combine-then-adapt: the mix sends the states of the previous round
            events += [Gossip(weights=weights), release]
    union = np.logical_or.reduce(graphs)
    order = (
        f"1 release then {steps} gossip step(s) per round"
        if method == "muffliato"
        else "1 gossip step then 1 release per round (combine-then-adapt)"
    )
    return NetworkSchedule(
        events=tuple(events),
        adjacency=union,
        releases=rounds,
        gossip_steps=int(steps),
        description=f"{method} on {topology} ({clients} nodes, {mixing} mixing): {rounds} rounds, {order}",
    )


def local_epsilon(
    noise_multiplier: float, releases: int, delta: float, sample_rate: float = 1.0
) -> float:
    """Local DP (pld) of `releases` Gaussian releases at `noise_multiplier` and `sample_rate`."""
    from p4bench.privacy.pld import pld_epsilon

    return pld_epsilon([(noise_multiplier, sample_rate, releases)], delta)


def noise_for_local_epsilon(
    epsilon: float, releases: int, delta: float, sample_rate: float = 1.0
) -> float:
    """The smallest noise multiplier (to 1%) whose local DP over `releases` is <= `epsilon`."""
    from p4bench.privacy.accountants import ReleaseSegment
    from p4bench.privacy.calibration import calibrate_accountant
    from p4bench.privacy.pld import PLDAccountant

    if not (np.isfinite(epsilon) and epsilon > 0):
        raise ConfigError("epsilon", f"must be a finite number > 0, got {epsilon}")
    segment = ReleaseSegment(noise_multiplier=1.0, sample_rate=sample_rate, steps=releases)
    return calibrate_accountant(
        PLDAccountant(), [segment], delta=delta, target_epsilon=epsilon, tolerance=0.01 * epsilon
    )
