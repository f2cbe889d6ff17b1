"""A private run's network DP: its exchanges as the accountant sees them, and the figures.

The recorder watches the run's network (`p4bench.engine.network.ObservedNetwork`): at every
exchange of the method it asks `Method.network_events` for what the exchange does (the
releases since the previous exchange, then the mixing) and keeps the events. Memory stays
bounded: an event holds an N x N matrix, and identical matrices (a static graph's W at every
step) are one object, so a run keeps one matrix per distinct mixing, not per exchange.

After the run, `summary` computes the pairwise privacy loss epsilon(u -> v)
(`p4bench.privacy.network_dp.pairwise_epsilon`) at the run's delta, each pair clipped to the
certified local epsilon of u (the ledger's, per client), against a single curious node, and
returns the summary keys: ``epsilon_network_max``, ``epsilon_network_mean``,
``epsilon_network_neighbour_mean``, ``epsilon_network_two_hop_mean`` (neighbours: nodes one
declared message apart) and ``network_dp`` (what the figures are, or "not applicable (why)"
for a method that does not declare its mixing, a run with an attack, or a run whose
exchanges the harness cannot observe). `write_artifacts` writes the matrix (CSV) and its
heatmap (PNG) into the run's folder, which the tracker logs to MLflow.

Release scales. A DP-SGD release of the mechanism (`batch_gradient`) is the noisy *mean*
(clipped sum + noise) / E_i with E_i = s * n_i, the client's expected batch: the same noise
multiplier, but clients with fewer records add larger noise to their state. The contract's
`Release` has one scale for every node, so where the E_i differ each release is declared
as diag(1/k) -> Release -> diag(k) with k_i = 1 / E_i (two diagonal mixings, no message):
exactly what the state receives. The mixing check (`p4bench.privacy.network_mixing`)
verifies on the run's messages that the state receives one common multiple of those means.
"""

from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from p4bench.privacy.network_events import Gossip, NetworkEvent, Release
from p4bench.privacy.network_mixing import method_exchange

__all__ = ["NetworkRecorder", "graph_adjacency"]

ARTIFACTS = ("network_epsilon.csv", "network_epsilon.png")


def graph_adjacency(events: list[NetworkEvent], num_nodes: int) -> np.ndarray:
    """(N, N) bool: u and v are neighbours where either ever received the other's message."""
    adjacency = np.zeros((num_nodes, num_nodes), dtype=bool)
    for weights in {id(e.weights): e.weights for e in events if isinstance(e, Gossip)}.values():
        adjacency |= weights != 0
    adjacency |= adjacency.T
    np.fill_diagonal(adjacency, False)
    return adjacency


# The accountant factorises each node's view: up to N x (releases)^3 operations. Beyond this
# bound (about 10 s on one core) a run does not stall on it at the end; the figure is then
# left to `p4bench privacy network`, which the summary names.
WORK_LIMIT = 2e10


class NetworkRecorder:
    """Records a prepared private run's declared exchanges (module docstring)."""

    def __init__(self, prepared: Any, resumed: bool = False) -> None:
        config = prepared.config
        self.private = bool(config.private) and prepared.ledger is not None
        self.method = prepared.job.method
        self.sigma = float(prepared.ledger.settings.noise_multiplier) if self.private else math.nan
        self.num_nodes = int(self.method.num_clients)
        self.events: list[NetworkEvent] = []
        self.epsilon: np.ndarray | None = None  # (N, N) [u, v] after `summary`
        self._shared: dict[bytes, Any] = {}
        self._occurrences: dict[tuple[str, str, int], int] = {}
        self._scales = self._release_scales(prepared) if self.private else None
        self.reason = self._not_applicable(prepared) if self.private else "not private"
        if self.private and resumed:  # the rounds before the checkpoint were not recorded
            self.reason = "resumed from a checkpoint: its first rounds' exchanges were not recorded"
        if self.reason is None:
            from p4bench.privacy.replay import observed

            prepared.runtime.network = observed(prepared.runtime.network, self.on_send)

    def _not_applicable(self, prepared: Any) -> str | None:
        config = prepared.config
        if config.attack:
            return f"attack '{config.attack}': its nodes send what no declaration says"
        if not hasattr(prepared.runtime, "network"):
            return f"runtime '{config.runtime}' runs its exchanges out of the harness's sight"
        why = self.method.network_dp_unavailable()
        return None if why is None else f"{config.method}: {why}"

    def _release_scales(self, prepared: Any) -> np.ndarray | None:
        """k_i = 1 / E_i relative to their largest, or None where every client's is the same."""
        counts = prepared.job.data.train.n.double().cpu().numpy()
        expected = np.maximum(prepared.config.data_rate * counts, 1.0)
        scales = expected.min() / expected
        return None if np.allclose(scales, 1.0, rtol=1e-12) else scales

    # -- recording ------------------------------------------------------------------------
    def on_send(self, exchange: str, phase: str, round_index: int, outgoing: Any) -> None:
        if self.reason is not None or not method_exchange(exchange):
            return
        key = (exchange, phase, round_index)
        occurrence = self._occurrences.get(key, 0)
        self._occurrences[key] = occurrence + 1
        declared = self.method.network_events(exchange, phase, round_index, occurrence)
        if declared is None:
            self.reason = f"{self.method.name} does not declare its exchange '{exchange}'"
            self.events = []
            return
        for event in declared:
            self.events.extend(self._declared(event))

    def _declared(self, event: NetworkEvent) -> list[NetworkEvent]:
        if isinstance(event, Gossip):
            return [self._gossip(np.asarray(event.weights, dtype=np.float64))]
        # the run's mechanism adds the noise: a declaration may not credit more than it drew
        sigma = event.noise_multiplier
        if math.isnan(sigma) or sigma > self.sigma:
            sigma = self.sigma
        nodes = np.asarray(event.nodes, dtype=bool)
        rate = float(event.sample_rate)
        release = self._one(
            b"r" + nodes.tobytes() + repr((sigma, rate)).encode(), Release(nodes, sigma, rate)
        )
        if self._scales is None:
            return [release]
        scales = np.where(nodes, self._scales, 1.0)
        return [self._gossip(np.diag(1.0 / scales)), release, self._gossip(np.diag(scales))]

    def _gossip(self, weights: np.ndarray) -> Gossip:
        digest = hashlib.blake2b(weights.tobytes(), digest_size=16).digest()
        return self._one(b"g" + digest, Gossip(weights))  # type: ignore[no-any-return]

    def _one(self, key: bytes, value: Any) -> Any:
        """The one object of each distinct event (bounded memory)."""
        return self._shared.setdefault(key, value)

    # -- the figures ----------------------------------------------------------------------
    def summary(self, ledger: Any) -> dict[str, Any]:
        """The summary keys (module docstring); empty for a run that is not private."""
        if not self.private:
            return {}
        if self.reason is None and not any(isinstance(e, Gossip) for e in self.events):
            self.reason = "no exchange ran"
        if self.reason is not None:
            return {"network_dp": f"not applicable ({self.reason})"}
        releases = sum(
            int(np.count_nonzero(e.nodes)) for e in self.events if isinstance(e, Release)
        )
        if self.num_nodes * float(releases) ** 3 > WORK_LIMIT:
            return {
                "network_dp": f"not computed in the run ({self.num_nodes} nodes, {releases} releases: "
                "beyond the run's accounting budget; `p4bench privacy network` computes it offline)"
            }
        from p4bench.privacy.network_accountant import network_accountant_for
        from p4bench.privacy.network_dp import summarize

        local = np.asarray(ledger.epsilons(), dtype=np.float64)
        events, sampling = self._sampled(ledger)
        result = network_accountant_for(ledger.accountant).pairwise(
            events, self.num_nodes, float(ledger.delta), colluders=1, local_epsilon=local,
            relation=ledger.settings.neighbouring,
        )  # fmt: skip
        self.epsilon = np.asarray(result.epsilon, dtype=np.float64)
        figures = summarize(result, graph_adjacency(self.events, self.num_nodes))
        return {
            **{k: float(v) for k, v in figures.items()},
            "network_dp": f"pairwise, one curious node, delta {float(ledger.delta):.3g}, "
            f"{sampling}",
        }

    def _sampled(self, ledger: Any) -> tuple[list[NetworkEvent], str]:
        """The events with the run's Poisson rate where a release leaves it to the run (NaN)
        or declares a lower one, and how the rate was set. The rate is the largest the ledger
        saw (the bound grows with it). It is credited only where each node declared exactly the steps the ledger
        counted for it (one release, one Poisson draw), and never under replace-one, whose
        subsampling the network analysis does not amplify."""
        keys = list(getattr(ledger, "keys", ()))
        rate = max((float(key[1]) for key in keys), default=1.0)
        counted = sum((np.asarray(ledger.steps[key]) for key in keys), np.zeros(self.num_nodes))
        declared = np.zeros(self.num_nodes)
        for event in self.events:
            if isinstance(event, Release):
                declared += np.asarray(event.nodes, dtype=bool)
        if ledger.settings.neighbouring != "add-remove":
            rate, how = 1.0, "no subsampling credit under replace-one"
        elif np.shape(counted) != declared.shape or not np.array_equal(counted, declared):
            rate, how = (
                1.0,
                "no subsampling credit: declared releases differ from the ledger's steps",
            )
        elif not 0.0 < rate < 1.0:
            rate, how = 1.0, "full-batch releases"
        else:
            how = f"Poisson rate {rate:.3g} per release"
        # a declared rate below the run's would credit sampling the ledger never saw
        filled: dict[int, NetworkEvent] = {}
        for event in self.events:
            if isinstance(event, Release) and not event.sample_rate >= rate:  # NaN included
                filled.setdefault(id(event), Release(event.nodes, event.noise_multiplier, rate))
        return [filled.get(id(event), event) for event in self.events], how

    def write_artifacts(self, folder: Path) -> list[Path]:
        """network_epsilon.csv (row u, column v: epsilon(u -> v)) and its heatmap."""
        if self.epsilon is None:
            return []
        table, picture = folder / ARTIFACTS[0], folder / ARTIFACTS[1]
        with open(table, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sender_u", *(f"observer_{v}" for v in range(self.num_nodes))])
            for u, row in enumerate(self.epsilon):
                writer.writerow([u, *(f"{x:.6g}" for x in row)])
        _heatmap(self.epsilon, picture)
        return [table, picture]


def _heatmap(epsilon: np.ndarray, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5.5, 4.5))
    shown = np.where(np.eye(len(epsilon), dtype=bool), np.nan, epsilon)
    image = axes.imshow(shown, cmap="viridis")
    figure.colorbar(image, ax=axes, label="epsilon(u -> v)")
    axes.set_xlabel("observer v")
    axes.set_ylabel("node u (whose record)")
    axes.set_title("pairwise network DP")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
