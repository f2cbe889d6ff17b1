"""Spectral report of a mixing matrix and PDSL's assumption A3 on it.

PDSL (Wang, Yuan, Wang, Li) needs W symmetric and doubly stochastic with
``max(|lambda_2|, |lambda_min|) <= sqrt(rho)`` and ``rho < 1``: the graph must be
connected and the gossip aperiodic, so a bipartite graph needs self loops. PDSL also
divides by every ``omega_ij`` of the neighbourhood, which includes i itself, so the
diagonal must be positive.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from p4bench.errors import ConfigError
from p4bench.topology.mixing import is_doubly_stochastic

__all__ = ["mixing_report", "check_pdsl_assumption"]


def mixing_report(weights: np.ndarray, atol: float = 1e-9) -> dict[str, Any]:
    """Spectrum, stochasticity and degrees of a mixing matrix W (M, M).

    Keys: ``rho`` = (second largest eigenvalue modulus)^2, which for a symmetric
    stochastic W is ``max(|lambda_2|, |lambda_min|)^2`` (A3's rho); ``lambda_1``,
    ``lambda_2``, ``lambda_min`` (eigenvalues in decreasing order; real parts when W is
    not symmetric); ``symmetric``, ``doubly_stochastic``, ``self_loops`` (every W_ii > 0);
    ``degree_min``/``degree_max``/``degree_mean`` (neighbours j != i with W_ij > 0) and
    ``omega_min`` (the smallest non-zero entry, PDSL's omega_min).
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2 or weights.shape[0] != weights.shape[1] or weights.shape[0] == 0:
        raise ValueError(f"weights must be a non-empty square matrix, got shape {weights.shape}")
    m = weights.shape[0]
    symmetric = bool(np.allclose(weights, weights.T, atol=atol))
    if symmetric:
        eigenvalues = np.sort(np.linalg.eigvalsh((weights + weights.T) / 2))[::-1]
        moduli = np.sort(np.abs(eigenvalues))[::-1]
    else:
        complex_eigenvalues = np.linalg.eigvals(weights)
        eigenvalues = np.sort(complex_eigenvalues.real)[::-1]
        moduli = np.sort(np.abs(complex_eigenvalues))[::-1]
    # The top modulus is lambda_1 = 1 for a stochastic W; a second one at 1 means a
    # disconnected (two eigenvalues 1) or periodic (eigenvalue -1) gossip.
    second = float(moduli[1]) if m > 1 else 0.0
    neighbours = (weights > 0) & ~np.eye(m, dtype=bool)
    degree = neighbours.sum(axis=1)
    positive = weights[weights > 0]
    return {
        "rho": second**2,
        "lambda_1": float(eigenvalues[0]),
        "lambda_2": float(eigenvalues[1]) if m > 1 else float("nan"),
        "lambda_min": float(eigenvalues[-1]),
        "symmetric": symmetric,
        "doubly_stochastic": is_doubly_stochastic(weights, atol),
        "self_loops": bool((np.diag(weights) > 0).all()),
        "degree_min": int(degree.min()),
        "degree_max": int(degree.max()),
        "degree_mean": float(degree.mean()),
        "omega_min": float(positive.min()) if positive.size else 0.0,
    }


def check_pdsl_assumption(weights: np.ndarray, atol: float = 1e-9) -> dict[str, Any]:
    """Raise ``ConfigError("topology", ...)`` unless W satisfies PDSL's A3; else return
    :func:`mixing_report` of W.

    Checked in order: rho < 1 (connected and aperiodic), W symmetric and doubly
    stochastic, and W_ii > 0 for every client.
    """
    report = mixing_report(weights, atol)
    if report["rho"] >= 1 - atol:
        raise ConfigError(
            "topology",
            f"PDSL's assumption A3 needs rho = max(|lambda_2|, |lambda_min|)^2 < 1, got rho = {report['rho']:.6g} "
            f"(lambda_2 = {report['lambda_2']:.6g}, lambda_min = {report['lambda_min']:.6g}): the graph is "
            "disconnected, or periodic (a bipartite graph without self loops); use Metropolis-Hastings weights",
        )
    if not (report["symmetric"] and report["doubly_stochastic"]):
        raise ConfigError(
            "topology",
            "PDSL needs a symmetric, doubly stochastic mixing matrix W (e.g. Metropolis-Hastings)",
        )
    if not report["self_loops"]:
        raise ConfigError(
            "topology",
            "PDSL needs W_ii > 0 for every client (its own gradient is one of the candidates)",
        )
    return report
