"""Noise calibration: the noise multiplier that meets a target epsilon, for any accountant."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from p4bench.errors import ConfigError, UsageError
from p4bench.privacy.accountants import (
    Accountant,
    ReleaseSegment,
    accounted_epsilon,
    native_relations,
)

__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "calibrate_noise",
    "calibrate_accountant",
    "default_delta",
    "DELTA_RULE",
]

# delta << 1/N: a mechanism that publishes one record in full with probability delta is
# (0, delta)-DP, so delta must be far below 1/N. N is the training records of the data set the
# clients' data is drawn from (not of the federation): every method on one data set then
# gets the same delta, also those that set public records aside (FedDF, PDSL), and it is at
# most 1/(10 N') for the N' records the clients hold.
DELTA_RULE = "1/(10 N), N the training records of the data set"


def default_delta(records: int) -> float:
    """A run's delta when none is given (`DELTA_RULE`)."""
    return 1.0 / (10 * max(int(records), 1))


MAX_NOISE_MULTIPLIER = 1e6
"""Noise multipliers above this are treated as "no noise level reaches the target"."""

_MAX_ITERATIONS = 200


def calibrate_noise(
    epsilon_fn: Callable[[float], float],
    target_epsilon: float,
    *,
    tolerance: float = 0.01,
    low: float = 0.0,
    high: float = 10.0,
    max_noise: float = MAX_NOISE_MULTIPLIER,
    floor: float | None = None,
) -> float:
    """The noise multiplier sigma whose epsilon is <= target and within `tolerance` of it.

    `epsilon_fn` maps sigma to epsilon and must be non-increasing in sigma (every
    accountant here is). `high` is doubled until ``epsilon_fn(high) <= target`` (up to
    `max_noise`); then bisection shrinks ``[low, high]`` while keeping
    ``epsilon_fn(high) <= target``, so the returned sigma never overshoots the target.
    It stops once ``target - epsilon_fn(high) <= tolerance``, or when the interval
    cannot shrink any further (an epsilon that jumps there), returning the last sigma
    that met the target.

    `floor`, when known, is the epsilon no noise gets below (the Noble bound's); a
    target at or below it is refused at once.

    Raises:
        UsageError: the target cannot be reached with noise up to `max_noise`; the
            message names the floor (or the epsilon at `max_noise`).
    """
    target_epsilon = float(target_epsilon)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("target_epsilon", f"must be a finite number > 0, got {target_epsilon}")
    if not tolerance > 0:
        raise ConfigError("tolerance", f"must be > 0, got {tolerance}")
    if not (0 <= low < high <= max_noise):
        raise ConfigError("high", f"need 0 <= low < high <= max_noise, got low={low}, high={high}")
    if floor is not None and floor >= target_epsilon:
        raise UsageError(
            f"target epsilon {target_epsilon:g} is unreachable: this bound has a noise-independent "
            f"floor of {floor:.4g} for these parameters (fewer rounds or steps, smaller sampling rates "
            f"or a larger delta lower it)"
        )

    eps_high = epsilon_fn(high)
    while not eps_high <= target_epsilon:  # also catches nan
        if high >= max_noise:
            raise UsageError(
                f"target epsilon {target_epsilon:g} is unreachable: even noise multiplier {high:g} gives "
                f"epsilon {eps_high:.4g}, which is about this accountant's noise-independent floor"
            )
        low, high = high, min(2 * high, max_noise)
        eps_high = epsilon_fn(high)

    for _ in range(_MAX_ITERATIONS):
        if target_epsilon - eps_high <= tolerance:
            break
        mid = (low + high) / 2
        if not low < mid < high:  # floating-point resolution reached
            break
        eps_mid = epsilon_fn(mid)
        if eps_mid <= target_epsilon:
            high, eps_high = mid, eps_mid
        else:
            low = mid
    return high


def calibrate_accountant(
    accountant: Accountant,
    history: Sequence[ReleaseSegment],
    *,
    delta: float,
    target_epsilon: float,
    tolerance: float = 0.01,
    neighbouring: str | None = None,
    **context: Any,
) -> float:
    """Noise multiplier that, used in every segment of `history`, meets `target_epsilon`.

    The segments' own `noise_multiplier` values are ignored (replaced by the one
    searched for). `neighbouring` (default: the accountant's first native relation)
    gives sigma its meaning as in runs, std / C (add-remove) or std / (2C)
    (replace-one); see :func:`accounted_epsilon`. `context` is passed to the accountant.
    """
    history = list(history)
    if not history:
        raise ConfigError("history", "needs at least one release segment to calibrate")

    relation = neighbouring or native_relations(accountant)[0]

    def epsilon_at(sigma: float) -> float:
        return accounted_epsilon(
            accountant,
            [replace(s, noise_multiplier=sigma) for s in history],
            delta,
            relation,
            **context,
        )

    floor = accountant.epsilon_floor(history, delta, **context)
    return calibrate_noise(epsilon_at, target_epsilon, tolerance=tolerance, floor=floor or None)
