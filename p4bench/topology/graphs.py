"""Communication graphs between clients, registered as ``topology`` plugins.

A topology returns, for a number of clients M and a round, a boolean adjacency
matrix ``A`` of shape (M, M) with ``A[i, j]`` true when client i sends to client j.
There are no self loops (mixing matrices add them). Undirected topologies return a
symmetric matrix.

A static topology (``time_varying = False``) is meant to be drawn once per run: the
runner calls :meth:`Topology.edges` once and reuses the result, and ``round_index`` is
ignored. Random static graphs depend only on the generator they are given.

Plugin-specific settings are declared in the class attribute ``options``
(:class:`p4bench.options.Option`); the constructor resolves a mapping of them into
``option_values`` (unknown keys are refused, naming the valid ones). A method's run
gives them as its ``topology_options``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from p4bench.errors import ConfigError
from p4bench.host.legacy import legacy_topology, read_option
from p4bench.options import Option, resolve_options
from p4bench.topology.properties import (  # re-exported: they were defined here
    degree_stats,
    exponential_shift,
    is_connected,
    is_symmetric,
    read_edge_list,
    torus_shape,
)

__all__ = [
    "Topology",
    "CompleteGraph",
    "RingGraph",
    "BipartiteGraph",
    "TorusGraph",
    "RandomRegularGraph",
    "ErdosRenyiGraph",
    "ExponentialGraph",
    "EdgeListGraph",
    "BUILTIN_TOPOLOGIES",
    "is_connected",
    "is_symmetric",
    "degree_stats",
    "torus_shape",
    "exponential_shift",
    "read_edge_list",
]


def _require_clients(num_clients: int, minimum: int, name: str) -> int:
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < minimum:
        raise ConfigError(
            "clients", f"the {name} topology needs at least {minimum} clients, got {num_clients}"
        )
    return int(num_clients)


# --- base class ----------------------------------------------------------------------


class Topology(ABC):
    """Base of topology plugins.

    Class attributes: `name`, `description`, `time_varying` (the graph changes with
    the round), `directed` (edges need not be symmetric) and `options` (the declared
    keys of the options mapping; resolved values are in `option_values`).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    # not ClassVars: a plugin may set them per instance from its options (edge-list, resample)
    time_varying: bool = False
    directed: bool = False
    options: ClassVar[tuple[Option, ...]] = ()

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if legacy_topology(self, options):  # a 0.1 topology (`option_help`): deprecated
            return
        self.option_values = resolve_options(
            self.options, options or {}, strict=True, owner=f"topology '{self.name}'"
        )

    def _option(
        self, key: str, default: Any, kind: type, check: Any = None, expect: str = ""
    ) -> Any:
        """0.1's reading of an `option_help` option (deprecated: declare `options`)."""
        return read_option(self, key, default, kind, check, expect)

    @abstractmethod
    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        """Boolean adjacency (M, M) at `round_index`; ``A[i, j]``: i sends to j."""


def _undirected(num_clients: int, pairs: Any) -> np.ndarray:
    adjacency = np.zeros((num_clients, num_clients), dtype=bool)
    for i, j in pairs:
        if i != j:
            adjacency[i, j] = adjacency[j, i] = True
    return adjacency


# --- deterministic graphs ------------------------------------------------------------


class CompleteGraph(Topology):
    """Every client talks to every other client."""

    name = "complete"
    description = "complete graph: every pair of clients is connected"

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 1, self.name)
        return ~np.eye(num_clients, dtype=bool)


class RingGraph(Topology):
    """Undirected cycle: client k talks to k-1 and k+1 (mod M)."""

    name = "ring"
    description = "undirected ring (cycle): each client talks to its two neighbours"

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 2, self.name)
        return _undirected(num_clients, ((k, (k + 1) % num_clients) for k in range(num_clients)))


class BipartiteGraph(Topology):
    """Complete bipartite graph between the first ceil(M/2) and the last floor(M/2) clients.

    Without self loops the gossip on it is periodic (eigenvalue -1); the self loops the
    mixing matrix adds (Metropolis-Hastings gives W_ii > 0) make it aperiodic, as PDSL's
    assumption A3 requires (`p4bench.topology.assumptions.check_pdsl_assumption`).
    """

    name = "bipartite"
    description = "complete bipartite graph: first ceil(M/2) clients x last floor(M/2) clients"

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 2, self.name)
        half = (num_clients + 1) // 2
        adjacency = np.zeros((num_clients, num_clients), dtype=bool)
        adjacency[:half, half:] = True
        return adjacency | adjacency.T


class TorusGraph(Topology):
    """2-D torus: clients on a rows x cols grid that wraps around; degree 4.

    Without the `rows`/`cols` options the most square factorisation of M is used. A
    grid with 2 rows (or 2 columns) still works but its up and down neighbours
    coincide, so degrees are 3 (2 for a 2 x 2 grid). A prime M has no grid and is
    refused.
    """

    name = "torus"
    description = "2-D torus (wrap-around grid, degree 4); M must factor as rows x cols"
    options = (
        Option("rows", int, None, "grid rows; default: the most square factorisation of M", low=2),
        Option("cols", int, None, "grid columns; default: M / rows", low=2),
    )

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 4, self.name)
        rows, cols = self.shape(num_clients)
        pairs = []
        for r in range(rows):
            for c in range(cols):
                k = r * cols + c
                pairs.append((k, r * cols + (c + 1) % cols))
                pairs.append((k, ((r + 1) % rows) * cols + c))
        return _undirected(num_clients, pairs)

    def shape(self, num_clients: int) -> tuple[int, int]:
        """(rows, cols) of the grid for `num_clients`."""
        rows, cols = self.option_values["rows"], self.option_values["cols"]
        if rows is None and cols is None:
            rows, cols = torus_shape(num_clients)
            if rows == 1:
                raise ConfigError(
                    "clients",
                    f"the torus topology needs M = rows x cols with rows, cols >= 2, and {num_clients} is prime; "
                    "use a composite number of clients or the 'ring' topology",
                )
            return rows, cols
        rows = rows if rows is not None else num_clients // cols
        cols = cols if cols is not None else num_clients // rows
        if rows * cols != num_clients:
            raise ConfigError(
                "options.rows",
                f"rows x cols must equal the {num_clients} clients, got {rows} x {cols}",
            )
        return rows, cols


class ExponentialGraph(Topology):
    """ProxyFL's time-varying directed exponential graph (a permutation every round).

    At round r client k sends to client (k + 2^(r mod (floor(log2(M-1)) + 1))) mod M,
    so every client has exactly one receiver and one sender, and the hops cycle
    through 1, 2, 4, ... up to the largest power of two below M.
    """

    name = "exponential"
    description = (
        "ProxyFL time-varying directed exponential graph: k sends to k + 2^(r mod log) mod M"
    )
    time_varying = True
    directed = True

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 2, self.name)
        shift = exponential_shift(num_clients, int(round_index))
        adjacency = np.zeros((num_clients, num_clients), dtype=bool)
        clients = np.arange(num_clients)
        adjacency[clients, (clients + shift) % num_clients] = True
        return adjacency


class EdgeListGraph(Topology):
    """A custom graph read from a text file of ``i j`` lines (``#`` starts a comment).

    Undirected unless the option ``directed`` is true; self loops are ignored. The file
    is read once, on first use.
    """

    name = "edge-list"
    description = "custom graph from an edge-list file ('i j' per line, '#' comments); option path"
    options = (
        Option("path", str, None, "edge-list file (required)"),
        Option("directed", bool, False, "read 'i j' as i -> j only"),
    )

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        if not self.option_values["path"]:
            raise ConfigError(
                "options.path", "the edge-list topology needs the option 'path' (an edge-list file)"
            )
        self.directed = self.option_values["directed"]  # instance-level override
        self._pairs: list[tuple[int, int]] | None = None

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        num_clients = _require_clients(num_clients, 1, self.name)
        if self._pairs is None:
            self._pairs = read_edge_list(self.option_values["path"])
        too_large = [max(p) for p in self._pairs if max(p) >= num_clients]
        if too_large:
            raise ConfigError(
                "options.path",
                f"edge list names client {max(too_large)} but there are only {num_clients} clients (0-based)",
            )
        if not self.directed:
            return _undirected(num_clients, self._pairs)
        adjacency = np.zeros((num_clients, num_clients), dtype=bool)
        for i, j in self._pairs:
            if i != j:
                adjacency[i, j] = True
        return adjacency


# --- random graphs -------------------------------------------------------------------


class _RandomGraph(Topology):
    """Shared options: ``max_tries`` and ``resample``, which makes the graph time-varying
    (a new draw per call)."""

    SHARED: ClassVar[tuple[Option, ...]] = (
        Option("max_tries", int, 100, "redraws until connected", low=1),
        Option("resample", bool, False, "draw a new graph at every call"),
    )
    options: ClassVar[tuple[Option, ...]] = SHARED

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.time_varying = self.option_values["resample"]  # instance-level override


class RandomRegularGraph(_RandomGraph):
    """Uniformly-ish random connected k-regular graph.

    Starts from the connected circulant graph (hops 1..k/2, plus the antipode when k is
    odd) and randomises it with degree-preserving double edge swaps, redrawing until
    connected. k = 2 is drawn directly as a random Hamiltonian cycle, since random
    2-regular graphs are rarely connected.
    """

    name = "k-regular"
    description = "random connected k-regular graph (option k, default 4)"
    options = (
        Option("k", int, None, "degree, in [1, M-1]; default: 4, or M-1 when M <= 4", low=1),
    ) + _RandomGraph.SHARED

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        m = _require_clients(num_clients, 2, self.name)
        k = self.option_values["k"] if self.option_values["k"] is not None else min(4, m - 1)
        if not 1 <= k < m:
            raise ConfigError("options.k", f"expected an integer in [1, {m - 1}], got {k!r}")
        if (m * k) % 2:
            raise ConfigError("options.k", f"a {k}-regular graph on {m} clients needs M*k even")
        if k == 1 and m > 2:
            raise ConfigError(
                "options.k", f"a 1-regular graph on {m} clients is never connected; use k >= 2"
            )
        if k == m - 1:
            return ~np.eye(m, dtype=bool)
        if k == 2:
            order = rng.permutation(m)
            return _undirected(m, ((order[i], order[(i + 1) % m]) for i in range(m)))
        max_tries = self.option_values["max_tries"]
        for _ in range(max_tries):
            adjacency = self._swap_randomised(m, k, rng)
            if is_connected(adjacency):
                return adjacency
        raise ConfigError(
            "options.k", f"no connected {k}-regular graph on {m} clients after {max_tries} draws"
        )

    @staticmethod
    def _swap_randomised(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
        hops = list(range(1, k // 2 + 1)) + ([m // 2] if k % 2 else [])
        edge_list = sorted({tuple(sorted((v, (v + h) % m))) for v in range(m) for h in hops})
        edge_set = set(edge_list)
        for _ in range(10 * len(edge_list)):
            x, y = rng.integers(len(edge_list), size=2)
            (a, b), (c, d) = edge_list[x], edge_list[y]
            if rng.random() < 0.5:
                c, d = d, c
            new1, new2 = tuple(sorted((a, c))), tuple(sorted((b, d)))
            if a == c or b == d or new1 in edge_set or new2 in edge_set or new1 == new2:
                continue  # would create a self loop or a double edge
            edge_set -= {edge_list[x], edge_list[y]}
            edge_set |= {new1, new2}
            edge_list[x], edge_list[y] = new1, new2
        return _undirected(m, edge_list)


class ErdosRenyiGraph(_RandomGraph):
    """Connected Erdos-Renyi graph G(M, p), redrawn until connected (bounded tries)."""

    name = "erdos-renyi"
    description = "connected Erdos-Renyi graph G(M, p) (option p, default 2 ln(M)/M)"
    options = (
        Option(
            "p",
            float,
            None,
            "edge probability; default: min(1, 2 ln(M)/M)",
            low=0,
            high=1,
            low_open=True,
        ),
    ) + _RandomGraph.SHARED

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        m = _require_clients(num_clients, 1, self.name)
        default_p = (
            min(1.0, 2 * math.log(m) / m) if m > 1 else 1.0
        )  # twice the connectivity threshold
        p = self.option_values["p"] if self.option_values["p"] is not None else default_p
        max_tries = self.option_values["max_tries"]
        upper = np.triu(np.ones((m, m), dtype=bool), k=1)
        for _ in range(max_tries):
            draw = (rng.random((m, m)) < p) & upper
            adjacency = draw | draw.T
            if is_connected(adjacency):
                return adjacency
        raise ConfigError(
            "options.p",
            f"no connected G({m}, {p:g}) in {max_tries} draws; raise p (ln(M)/M = {math.log(m) / m:.3g})",
        )


BUILTIN_TOPOLOGIES: tuple[type[Topology], ...] = (
    CompleteGraph,
    RingGraph,
    BipartiteGraph,
    TorusGraph,
    RandomRegularGraph,
    ErdosRenyiGraph,
    ExponentialGraph,
    EdgeListGraph,
)
