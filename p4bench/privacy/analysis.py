"""Pure privacy-accounting math: epsilon of Gaussian releases under three analyses.

Every function here is stateless and takes its privacy parameters as keyword-only
arguments, in the style of ``opacus.accountants.analysis``:

- RDP of the Poisson-subsampled Gaussian (Mironov et al. 2019) through Opacus'
  ``compute_rdp``, converted to (epsilon, delta) with Balle et al. 2020;
- PRV (Gopi et al. 2021) through Opacus' PRV accountant, a numerically tight bound;
- the nested bound of Noble, Bellet & Dieuleveut (2022), used by the P4 paper to
  calibrate noise, in `p4bench.privacy.noble`.

A *history* is a sequence of ``(noise_multiplier, sample_rate, steps)`` triples, as in
Opacus: releases of one client whose parameters changed over time. Its segments are
composed (RDP adds up order by order; PRVs are convolved).

Invalid numbers raise :class:`p4bench.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import numpy as np

from p4bench.errors import ConfigError, UsageError

__all__ = [
    "DEFAULT_ORDERS",
    "NOBLE_MAX_ORDER",
    "VIEWS",
    "History",
    "PrivacyAccountingError",
    "rdp_epsilon",
    "rdp_epsilon_history",
    "rdp_privacy_spent",
    "prv_epsilon",
    "prv_epsilon_history",
    "check_count",
    "checked_history",
    "check_delta",
    "check_positive",
    "check_rate",
]

History = Sequence[tuple[float, float, int]]
"""Segments ``(noise_multiplier, sample_rate, steps)`` of one client's releases."""

# Opacus' default orders (1.1..10.9 by 0.1, 12..63) refined to steps of 0.05 below 11,
# where the optimum lies for moderate and large epsilons, plus a few large integer
# orders for very small epsilons. Orders closer to 1 than 1.05 are costly to evaluate
# (the fractional-order series converges slowly) and only matter for epsilon >> 100.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [round(1 + x / 20, 2) for x in range(1, 200)] + list(range(11, 64)) + [80, 96, 128, 192, 256]
)

NOBLE_MAX_ORDER = 100
"""Largest integer order searched by the Noble bound (as in the reference script)."""

VIEWS = ("third-party", "aggregator")
"""Threat views of the Noble bound: who observes the noisy updates."""

# Above this many grid points the PRV discretisation takes gigabytes and minutes; it
# only happens for very large epsilons, where the RDP accountant is as good.
_MAX_PRV_DOMAIN_POINTS = 25_000_000


class PrivacyAccountingError(UsageError):
    """An accountant cannot evaluate this request numerically (exits with code 2)."""


# --- validation --------------------------------------------------------------------


def check_positive(field: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(field, f"must be a finite number > 0, got {value}")
    return value


def check_rate(field: str, value: float) -> float:
    value = float(value)
    if not (0 < value <= 1):
        raise ConfigError(field, f"must be in (0, 1], got {value}")
    return value


def check_count(field: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value}")
    return int(value)


def check_delta(value: float) -> float:
    value = float(value)
    if not (0 < value < 1):
        raise ConfigError("delta", f"must be in (0, 1), got {value}")
    return value


def checked_history(history: History) -> list[tuple[float, float, int]]:
    checked = []
    for i, segment in enumerate(history):
        try:
            noise_multiplier, sample_rate, steps = segment
        except (TypeError, ValueError):
            raise ConfigError(
                f"history[{i}]", f"expected (noise_multiplier, sample_rate, steps), got {segment!r}"
            ) from None
        steps = check_count(f"history[{i}].steps", steps)
        if steps:  # zero-step segments cost nothing and are dropped
            checked.append(
                (
                    check_positive(f"history[{i}].noise_multiplier", noise_multiplier),
                    check_rate(f"history[{i}].sample_rate", sample_rate),
                    steps,
                )
            )
    return checked


# --- RDP of the Poisson-subsampled Gaussian ----------------------------------------


def rdp_privacy_spent(
    *, history: History, delta: float, orders: Sequence[float] | None = None
) -> tuple[float, float]:
    """(epsilon, best order) of a composed history under RDP accounting.

    The RDP curves of the segments are added order by order and converted to
    (epsilon, delta) with Balle et al. 2020 (Opacus' ``get_privacy_spent``). An empty
    history (or one with zero steps) costs ``(0.0, nan)``.
    """
    from opacus.accountants.analysis.rdp import get_privacy_spent

    delta = check_delta(delta)
    segments = checked_history(history)
    if not segments:
        return 0.0, math.nan
    orders = tuple(DEFAULT_ORDERS if orders is None else orders)
    rdp = np.zeros(len(orders))
    for noise_multiplier, sample_rate, steps in segments:
        # RDP composes linearly in the number of steps: compute one step's curve once.
        rdp += steps * _one_step_rdp(float(sample_rate), float(noise_multiplier), orders)
    with warnings.catch_warnings():
        # Opacus warns when the optimum is at the edge of the grid; for epsilons that
        # large the bound is meaningless anyway, and callers get the order back.
        warnings.simplefilter("ignore", UserWarning)
        epsilon, order = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(epsilon), float(order)


@functools.lru_cache(maxsize=4096)
def _one_step_rdp(
    sample_rate: float, noise_multiplier: float, orders: tuple[float, ...]
) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp

    curve: np.ndarray = compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders)
    )
    curve.setflags(write=False)
    return curve


def rdp_epsilon_history(
    *, history: History, delta: float, orders: Sequence[float] | None = None
) -> float:
    """Epsilon of a composed history of Poisson-subsampled Gaussian releases (RDP)."""
    return rdp_privacy_spent(history=history, delta=delta, orders=orders)[0]


def rdp_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[float] | None = None,
) -> float:
    """Epsilon after `steps` Poisson-subsampled Gaussian releases, by RDP accounting.

    >>> round(rdp_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=1200, delta=1e-3), 2)
    86.78
    """
    return rdp_epsilon_history(
        history=[(noise_multiplier, sample_rate, steps)], delta=delta, orders=orders
    )


# --- PRV -----------------------------------------------------------------------------


def prv_epsilon_history(
    *, history: History, delta: float, eps_error: float = 0.01, delta_error: float | None = None
) -> float:
    """Upper bound on epsilon of a composed history with Opacus' PRV accountant.

    `eps_error` and `delta_error` (default ``delta / 1000``) set the discretisation
    accuracy; the returned value is the accountant's upper bound, so it is a valid
    guarantee. Raises :class:`PrivacyAccountingError` when the discretisation would
    be too large to compute (tiny noise with many steps: use RDP there) or fails.
    """
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.prv import (
        PoissonSubsampledGaussianPRV,
        compute_safe_domain_size,
    )

    delta = check_delta(delta)
    eps_error = check_positive("eps_error", eps_error)
    delta_error = (
        delta / 1000 if delta_error is None else check_positive("delta_error", delta_error)
    )
    segments = checked_history(history)
    if not segments:
        return 0.0

    # Same domain Opacus will build (PRVAccountant._get_domain): refuse sizes that
    # would exhaust memory instead of letting the process be killed.
    total_steps = sum(steps for _, _, steps in segments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus' RDP grid-edge warning
        half_width = compute_safe_domain_size(
            prvs=[PoissonSubsampledGaussianPRV(q, s) for s, q, _ in segments],
            max_self_compositions=[steps for _, _, steps in segments],
            eps_error=eps_error,
            delta_error=delta_error,
        )
    mesh = eps_error / math.sqrt(total_steps * math.log(12 / delta_error) / 2)
    if 2 * half_width / mesh > _MAX_PRV_DOMAIN_POINTS:
        raise PrivacyAccountingError(
            f"the PRV accountant would need {2 * half_width / mesh:.2g} grid points for this history "
            f"(epsilon is very large: RDP bounds it by about {half_width - 3:.3g} at delta/4000); "
            "use the 'rdp' accountant instead"
        )

    accountant = PRVAccountant()
    accountant.history = list(segments)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter(
                "ignore", UserWarning
            )  # Opacus' RDP grid-edge warning (domain size)
            epsilon = accountant.get_epsilon(
                delta=delta, eps_error=eps_error, delta_error=delta_error
            )
    except (RuntimeError, ValueError, FloatingPointError) as exc:
        raise PrivacyAccountingError(
            f"the PRV accountant failed ({exc}); use the 'rdp' accountant instead"
        ) from exc
    return float(epsilon)


def prv_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> float:
    """Upper bound on epsilon after `steps` Poisson-subsampled Gaussian releases (PRV)."""
    return prv_epsilon_history(
        history=[(noise_multiplier, sample_rate, steps)],
        delta=delta,
        eps_error=eps_error,
        delta_error=delta_error,
    )


# --- Noble, Bellet & Dieuleveut ------------------------------------------------------
