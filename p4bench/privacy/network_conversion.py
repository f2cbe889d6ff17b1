"""From the pairwise Gaussian sensitivity of a network view to epsilon at delta.

The network-DP accountant (`p4bench.privacy.network_dp`) bounds what a view reveals about one
record by a Gaussian mechanism of (whitened) sensitivity mu: the view under the two
neighbouring datasets is two Gaussians whose means are at Mahalanobis distance at most mu,
i.e. mu-GDP (Dong, Roth & Su 2022). Two conversions to (epsilon, delta) are offered:

- ``gdp`` (the default): the exact privacy profile of the Gaussian mechanism (Balle & Wang
  2018, Theorem 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), inverted
  by bisection. It is what the suite's ``pld`` accountant gives for the same full-batch
  Gaussian releases (up to its pessimistic discretisation), so a pair that sees every
  release of u gets exactly u's local epsilon.
- ``rdp``: the Renyi curve alpha mu^2 / 2, converted with Balle et al. 2020 (the
  conversion Opacus' ``get_privacy_spent`` and the suite's ``rdp`` accountant use),
  minimised over `p4bench.privacy.analysis.DEFAULT_ORDERS`. Looser than ``gdp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import log_ndtr, ndtr

from p4bench.errors import ConfigError
from p4bench.privacy.analysis import DEFAULT_ORDERS, check_delta

__all__ = ["CONVERSIONS", "gaussian_epsilon", "rdp_curve_epsilon", "sensitivity_epsilon"]

CONVERSIONS = ("gdp", "rdp")

_BISECTION_STEPS = 200  # halves the bracket to well below 1e-12 relative


def _gaussian_delta(epsilon: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """delta(eps) of mu-GDP, with the e^eps factor taken in log space (no overflow)."""
    first = ndtr(mu / 2.0 - epsilon / mu)
    second = np.exp(epsilon + log_ndtr(-mu / 2.0 - epsilon / mu))
    return np.asarray(first - second)


def gaussian_epsilon(mu: np.ndarray | float, delta: float) -> np.ndarray:
    """Smallest epsilon >= 0 with delta(eps) <= `delta` for mu-GDP, elementwise.

    mu = 0 gives 0 and mu = inf gives inf. The search brackets eps between 0 and the
    classical bound mu^2/2 + mu sqrt(2 log(1/delta)), which always satisfies the target;
    the upper end of the final bracket is returned, so the result never undershoots.
    """
    delta = check_delta(delta)
    mu = np.asarray(mu, dtype=float)
    if np.any(np.isnan(mu)) or np.any(mu < 0):
        raise ConfigError("mu", "Gaussian sensitivities must be >= 0 (NaN given)")
    result = np.zeros_like(mu)
    result[np.isinf(mu)] = math.inf
    finite = np.isfinite(mu) & (mu > 0)
    if not finite.any():
        return result
    m = mu[finite]
    low = np.zeros_like(m)
    high = m**2 / 2.0 + m * math.sqrt(2.0 * math.log(1.0 / delta)) + 1e-12
    already = _gaussian_delta(low, m) <= delta
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        meets = _gaussian_delta(middle, m) <= delta
        high = np.where(meets, middle, high)
        low = np.where(meets, low, middle)
        if np.all(high - low <= 1e-12 * np.maximum(1.0, high)):
            break
    result[finite] = np.where(already, 0.0, high)
    return result


def rdp_curve_epsilon(
    mu: np.ndarray | float, delta: float, orders: Sequence[float] | None = None
) -> np.ndarray:
    """Epsilon of the Renyi curve alpha mu^2 / 2 by Balle et al. 2020, elementwise."""
    delta = check_delta(delta)
    mu = np.asarray(mu, dtype=float)
    alphas = np.asarray(DEFAULT_ORDERS if orders is None else orders, dtype=float)
    if np.any(alphas <= 1):
        raise ConfigError("orders", "Renyi orders must be > 1")
    with np.errstate(invalid="ignore"):  # inf * alpha stays inf; 0 * inf never occurs
        rdp = mu[..., None] ** 2 * alphas / 2.0
    eps = rdp + np.log1p(-1.0 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1.0)
    best: np.ndarray = np.where(mu == 0, 0.0, np.maximum(0.0, eps.min(axis=-1)))
    return best


def sensitivity_epsilon(mu: np.ndarray, delta: float, conversion: str = "gdp") -> np.ndarray:
    """Epsilon at `delta` of Gaussian sensitivities `mu` by `conversion` (``gdp`` | ``rdp``)."""
    if conversion == "gdp":
        return gaussian_epsilon(mu, delta)
    if conversion == "rdp":
        return rdp_curve_epsilon(mu, delta)
    raise ConfigError("conversion", f"must be one of {', '.join(CONVERSIONS)}, got {conversion!r}")
