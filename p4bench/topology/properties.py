"""Properties of adjacency matrices (symmetry, connectivity, degrees) and the arithmetic of
the built-in graphs (a torus's shape, the exponential graph's shift, edge-list files),
without the graph classes (`p4bench.topology.graphs`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from p4bench.errors import ConfigError

__all__ = [
    "degree_stats",
    "exponential_shift",
    "is_connected",
    "is_symmetric",
    "read_edge_list",
    "torus_shape",
]


def is_symmetric(adjacency: np.ndarray) -> bool:
    """True when every edge goes both ways (an undirected graph)."""
    return bool(np.array_equal(adjacency, adjacency.T))


def is_connected(adjacency: np.ndarray) -> bool:
    """True when the graph is connected; directed graphs must be strongly connected.

    A single client counts as connected.
    """
    from scipy.sparse.csgraph import (
        connected_components,
    )  # imported here: not needed to list the topologies

    adjacency = np.asarray(adjacency, dtype=bool)
    if adjacency.shape[0] <= 1:
        return True
    n, _ = connected_components(adjacency.astype(np.int8), directed=True, connection="strong")
    return bool(n == 1)


def degree_stats(adjacency: np.ndarray) -> dict[str, float]:
    """Min, mean and max of the out-degree (row sums) and in-degree (column sums)."""
    adjacency = np.asarray(adjacency, dtype=bool)
    out_degree, in_degree = adjacency.sum(axis=1), adjacency.sum(axis=0)
    return {
        "out_min": int(out_degree.min()),
        "out_mean": float(out_degree.mean()),
        "out_max": int(out_degree.max()),
        "in_min": int(in_degree.min()),
        "in_mean": float(in_degree.mean()),
        "in_max": int(in_degree.max()),
    }


def torus_shape(num_clients: int) -> tuple[int, int]:
    """The most square factorisation rows x cols of `num_clients`, rows <= cols."""
    rows = max(d for d in range(1, math.isqrt(num_clients) + 1) if num_clients % d == 0)
    return rows, num_clients // rows


def exponential_shift(num_clients: int, round_index: int) -> int:
    """ProxyFL's hop at a round: 2^(r mod (floor(log2(M-1)) + 1))."""
    period = (num_clients - 1).bit_length()  # floor(log2(M-1)) + 1 for M >= 2
    return int(2 ** (round_index % period))


def read_edge_list(path: str | Path) -> list[tuple[int, int]]:
    """Edges of a text file with one ``i j`` pair per line.

    Blank lines and everything after ``#`` are ignored. Indices are 0-based clients.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            "options.path", f"cannot read edge list {str(path)!r}: {exc.strerror or exc}"
        ) from None
    edges = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            i, j = (int(f) for f in fields)
        except ValueError:
            raise ConfigError(
                "options.path",
                f"{path}:{number}: expected two integer client indices 'i j', got {line.strip()!r}",
            ) from None
        if i < 0 or j < 0:
            raise ConfigError(
                "options.path", f"{path}:{number}: client indices must be >= 0, got {i} {j}"
            )
        edges.append((i, j))
    return edges
