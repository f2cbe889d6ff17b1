"""Mixing (gossip) matrices of a communication graph and their spectral gap.

Convention: ``W[i, j]`` is the weight client i gives to the model it receives from
client j, so a gossip step is ``x_new = W @ x`` and every row sums to 1. With the
adjacency convention of :mod:`p4bench.topology.graphs` (``A[i, j]``: i sends to j),
client i receives from j when ``A[j, i]`` is true.
"""

from __future__ import annotations

import numpy as np

from p4bench.errors import IncompatibleError
from p4bench.topology.graphs import is_symmetric

__all__ = [
    "metropolis_hastings",
    "uniform_averaging",
    "spectral_gap",
    "is_doubly_stochastic",
    "is_row_stochastic",
]


def metropolis_hastings(adjacency: np.ndarray) -> np.ndarray:
    """Metropolis-Hastings weights of an undirected graph.

    ``W[i, j] = 1 / (1 + max(deg_i, deg_j))`` on edges and ``W[i, i] = 1 - sum_j W[i, j]``.
    The matrix is symmetric with non-negative entries, hence doubly stochastic, on
    every undirected graph (regular or not). Directed graphs are refused.
    """
    adjacency = _adjacency(adjacency)
    if not is_symmetric(adjacency):
        raise IncompatibleError("Metropolis-Hastings weights need an undirected (symmetric) graph")
    degree = adjacency.sum(axis=1)
    weights = np.where(adjacency, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
    np.fill_diagonal(weights, 1.0 - weights.sum(axis=1))
    return weights


def uniform_averaging(adjacency: np.ndarray) -> np.ndarray:
    """Uniform averaging over the in-neighbours and oneself.

    ``W[i, j] = 1 / (1 + indeg_i)`` for j = i and every j that sends to i. Rows sum
    to 1 (row-stochastic) but columns in general do not: column j sums to 1 for every
    j only when all in- and out-degrees are equal (regular graphs, the exponential
    graph). On an irregular graph plain averaging is *not* doubly stochastic and
    biases the consensus towards well-connected clients. Works on directed graphs.
    """
    adjacency = _adjacency(adjacency)
    receives = adjacency.T | np.eye(adjacency.shape[0], dtype=bool)  # receives[i, j]: i hears j
    weights: np.ndarray = receives / receives.sum(axis=1, keepdims=True)
    return weights


def spectral_gap(weights: np.ndarray) -> float:
    """1 minus the second largest eigenvalue modulus of a stochastic matrix.

    For a connected graph with self loops the gap is in (0, 1]; 0 means the gossip
    does not mix (disconnected graph, or a periodic one). A 1 x 1 matrix has gap 1.
    """
    weights = np.asarray(weights, dtype=float)
    if weights.shape[0] <= 1:
        return 1.0
    if np.allclose(weights, weights.T):
        moduli = np.abs(np.linalg.eigvalsh(weights))
    else:
        moduli = np.abs(np.linalg.eigvals(weights))
    moduli = np.sort(moduli)[::-1]
    return float(max(0.0, 1.0 - moduli[1]))


def is_row_stochastic(weights: np.ndarray, atol: float = 1e-9) -> bool:
    """Non-negative entries and every row sums to 1."""
    weights = np.asarray(weights, dtype=float)
    return bool((weights >= -atol).all() and np.allclose(weights.sum(axis=1), 1.0, atol=atol))


def is_doubly_stochastic(weights: np.ndarray, atol: float = 1e-9) -> bool:
    """Non-negative entries and every row and every column sums to 1."""
    weights = np.asarray(weights, dtype=float)
    return is_row_stochastic(weights, atol) and bool(
        np.allclose(weights.sum(axis=0), 1.0, atol=atol)
    )


def _adjacency(adjacency: np.ndarray) -> np.ndarray:
    adjacency = np.asarray(adjacency, dtype=bool)
    if adjacency.ndim != 2 or adjacency.shape[0] != adjacency.shape[1]:
        raise ValueError(f"adjacency must be a square matrix, got shape {adjacency.shape}")
    adjacency = adjacency.copy()
    np.fill_diagonal(adjacency, False)  # self loops are added by the weights themselves
    return adjacency
