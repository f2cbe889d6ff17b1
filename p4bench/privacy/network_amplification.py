"""Amplification by Poisson subsampling in the pairwise network-DP analysis.

The linear-Gaussian analysis (`p4bench.privacy.network_dp`) treats every release of u as
if the record took part in it. A DP-SGD release samples each record with probability q
(Poisson), and the run's local-DP figure counts that amplification; without it the pairwise
figure of a distant pair can exceed the local one and is clipped to it, so the analysis
would show no gain from gossip at all. This module bounds the same view with the sampling.

Reduction. For observer v (or a coalition), Q = D^-1 P_v D^-1 on u's n_u releases is the
Gram matrix of the whitened shifts of u's releases inside v's view. Take any F with
F^T F = Q: the view is, up to noise independent of the record, y = F (b o e) + z with z
standard Gaussian in rank(Q) dimensions, b_r ~ Bernoulli(q_r) the record's participation
in release r and |e_r| <= 1 its clipped contribution. Split the noise of each coordinate k
into independent parts, z_k = sum_r z_kr with Var z_kr = v_kr, sum_r v_kr = 1. Then y is
the sum (a post-processing) of n_u independent mechanisms M_r = F[:, r] b_r e_r + z[:, r],
each a Poisson-subsampled Gaussian of rate q_r and sensitivity
s_r^2 = sum_k F_kr^2 / v_kr; their Renyi curves add. With v_kr proportional to |F_kr| (the
split that minimises sum_r s_r^2, i.e. the unamplified bound) s_r^2 = sum_k |F_kr| * sum_r'
|F_kr'|. Two factorisations are tried, F = Lambda^1/2 V^T (eigenbasis) and F = Q^1/2
(symmetric root), and the smaller curve is kept order by order (each bounds the same
divergence). A diagonal Q (orthogonal contributions) gives exactly the composition of u's
subsampled releases at their projected sensitivities; a rank-one Q gives the one mechanism
it is.

Each release's curve is the Renyi DP of the sampled Gaussian mechanism at integer orders
(Mironov, Talwar & Zhang 2019: log A_alpha / (alpha - 1) with A_alpha = sum_k C(alpha, k)
(1 - q)^(alpha - k) q^k exp((k^2 - k) s^2 / 2), which bounds both orders of the divergence
for add/remove-one neighbours), converted to (epsilon, delta) with Balle et al. 2020.
Sensitivities are rounded *up* to a geometric grid so that curves are shared (the curve
grows with s), which keeps dense graphs affordable.

Scope. The noise split is a proof for contributions fixed in advance; for gradients taken
at states the observer does not see it is the same modelling step as the unamplified
analysis (see `p4bench.privacy.network_dp`, "Adaptivity"). Under replace-one neighbours the
recorder declares no sampling (q = 1): amplification for substitution is not analysed here.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln, logsumexp

from p4bench.privacy.analysis import check_delta

__all__ = ["AMPLIFIED_ORDERS", "amplified_epsilon", "release_sensitivities", "sampled_rdp"]

AMPLIFIED_ORDERS: tuple[int, ...] = (*range(2, 33), 40, 48, 56, 64, 80, 96, 128, 192, 256)
"""Integer Renyi orders (the closed form of the sampled Gaussian holds at integers)."""

_GRID_RATIO = 1.002  # sensitivities are rounded up to powers of this ratio


def _factorisations(gram: np.ndarray) -> list[np.ndarray]:
    """(..., k, n) factors F with F^T F = gram: eigenbasis rows and the symmetric root."""
    values, vectors = np.linalg.eigh(gram)
    roots = np.sqrt(np.clip(values, 0.0, None))
    eigen = roots[..., :, None] * np.swapaxes(vectors, -1, -2)
    symmetric = (vectors * roots[..., None, :]) @ np.swapaxes(vectors, -1, -2)
    return [eigen, symmetric]


def release_sensitivities(factor: np.ndarray) -> np.ndarray:
    """(..., n) s_r^2 of the noise split v_kr ~ |F_kr| (module docstring)."""
    magnitude = np.abs(factor)
    rows = magnitude.sum(axis=-1, keepdims=True)  # (..., k, 1)
    squared: np.ndarray = (magnitude * rows).sum(axis=-2)
    return squared


def sampled_rdp(rate: np.ndarray, squared: np.ndarray) -> np.ndarray:
    """(..., orders) Renyi DP of the sampled Gaussian of rate q and sensitivity^2 s^2 (unit
    noise) at `AMPLIFIED_ORDERS`; 0 where s = 0, inf where s = inf."""
    rate = np.asarray(rate, dtype=float)
    squared = np.asarray(squared, dtype=float)
    shape = np.broadcast_shapes(rate.shape, squared.shape)
    flat_rate = np.broadcast_to(rate, shape).ravel()
    flat_squared = np.broadcast_to(squared, shape).ravel()
    finite = np.isfinite(flat_squared) & (flat_squared > 0)
    grid = np.zeros_like(flat_squared)
    step = math.log(_GRID_RATIO)
    grid[finite] = np.exp(np.ceil(np.log(flat_squared[finite]) / step) * step)
    keys = np.stack([flat_rate, grid], axis=1)
    unique, inverse = np.unique(keys[finite], axis=0, return_inverse=True)
    curves = np.zeros((flat_squared.size, len(AMPLIFIED_ORDERS)))
    curves[~np.isfinite(flat_squared)] = math.inf
    if unique.size:
        curves[finite] = _curves(unique[:, 0], unique[:, 1])[inverse.ravel()]
    result: np.ndarray = curves.reshape(*shape, len(AMPLIFIED_ORDERS))
    return result


def _curves(rate: np.ndarray, squared: np.ndarray) -> np.ndarray:
    """(m, orders): log A_alpha / (alpha - 1) for each (q, s^2)."""
    out = np.empty((rate.size, len(AMPLIFIED_ORDERS)))
    full = rate >= 1.0
    with np.errstate(divide="ignore"):
        log_q, log_rest = np.log(rate)[:, None], np.log1p(-np.minimum(rate, 1.0))[:, None]
    for column, alpha in enumerate(AMPLIFIED_ORDERS):
        k = np.arange(alpha + 1, dtype=float)
        binomial = gammaln(alpha + 1) - gammaln(k + 1) - gammaln(alpha - k + 1)
        with np.errstate(invalid="ignore"):  # 0 * -inf where q = 1: those rows are replaced
            terms = (
                binomial + k * log_q + (alpha - k) * log_rest + (k * k - k) * squared[:, None] / 2.0
            )
        terms = np.where(np.isnan(terms), -math.inf, terms)
        out[:, column] = logsumexp(terms, axis=1) / (alpha - 1)
        out[full, column] = alpha * squared[full] / 2.0
    return out


def _rdp_to_epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """Balle et al. 2020 conversion of curves (..., orders), minimised over the orders."""
    alphas = np.asarray(AMPLIFIED_ORDERS, dtype=float)
    eps = rdp + np.log1p(-1.0 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1.0)
    best: np.ndarray = np.maximum(0.0, eps.min(axis=-1))
    return best


def amplified_epsilon(gram: np.ndarray, rates: np.ndarray, delta: float) -> np.ndarray:
    """(N,) epsilon at `delta` of each node's releases in one view, with their sampling.

    `gram`: (N, n_max, n_max) D^-1 P D^-1 on each node's releases (zero rows and columns
    for padding); `rates`: (N, n_max) each release's Poisson rate (anything for padding).
    """
    delta = check_delta(delta)
    best: np.ndarray | None = None
    for factor in _factorisations(gram):
        curve = sampled_rdp(rates, release_sensitivities(factor)).sum(axis=-2)
        best = curve if best is None else np.minimum(best, curve)
    assert best is not None
    return _rdp_to_epsilon(best, delta)
