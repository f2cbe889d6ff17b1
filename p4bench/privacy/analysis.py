"""Pure privacy-accounting math: epsilon of Gaussian releases under three analyses.

Every function here is stateless and takes its privacy parameters as keyword-only
arguments, in the style of ``opacus.accountants.analysis``:

- RDP of the Poisson-subsampled Gaussian (Mironov et al. 2019) through Opacus'
  ``compute_rdp``, converted to (epsilon, delta) with Balle et al. 2020;
- PRV (Gopi et al. 2021) through Opacus' PRV accountant, a numerically tight bound;
- the nested bound of Noble, Bellet & Dieuleveut (2022), used by the P4 paper to
  calibrate noise: subsampling without replacement (Wang, Balle & Kasiviswanathan
  2019, Theorem 9) applied to the data ratio inside a round and to the client ratio
  outside, then the classic RDP conversion.

A *history* is a sequence of ``(noise_multiplier, sample_rate, steps)`` triples, as in
Opacus: releases of one client whose parameters changed over time. Its segments are
composed (RDP adds up order by order; PRVs are convolved).

Invalid numbers raise :class:`p4bench.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence

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
    "noble_epsilon",
    "noble_privacy_spent",
    "noble_rdp",
    "noble_epsilon_floor",
    "mironov_conversion",
    "wbk_subsampled_log_moment",
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


def _positive(field: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(field, f"must be a finite number > 0, got {value}")
    return value


def _rate(field: str, value: float) -> float:
    value = float(value)
    if not (0 < value <= 1):
        raise ConfigError(field, f"must be in (0, 1], got {value}")
    return value


def _count(field: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value}")
    return int(value)


def _delta(value: float) -> float:
    value = float(value)
    if not (0 < value < 1):
        raise ConfigError("delta", f"must be in (0, 1), got {value}")
    return value


def _history(history: History) -> list[tuple[float, float, int]]:
    checked = []
    for i, segment in enumerate(history):
        try:
            noise_multiplier, sample_rate, steps = segment
        except (TypeError, ValueError):
            raise ConfigError(
                f"history[{i}]", f"expected (noise_multiplier, sample_rate, steps), got {segment!r}"
            ) from None
        steps = _count(f"history[{i}].steps", steps)
        if steps:  # zero-step segments cost nothing and are dropped
            checked.append(
                (
                    _positive(f"history[{i}].noise_multiplier", noise_multiplier),
                    _rate(f"history[{i}].sample_rate", sample_rate),
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

    delta = _delta(delta)
    segments = _history(history)
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
def _one_step_rdp(sample_rate: float, noise_multiplier: float, orders: tuple[float, ...]) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp

    curve: np.ndarray = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders))
    curve.setflags(write=False)
    return curve


def rdp_epsilon_history(*, history: History, delta: float, orders: Sequence[float] | None = None) -> float:
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
    return rdp_epsilon_history(history=[(noise_multiplier, sample_rate, steps)], delta=delta, orders=orders)


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
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

    delta = _delta(delta)
    eps_error = _positive("eps_error", eps_error)
    delta_error = delta / 1000 if delta_error is None else _positive("delta_error", delta_error)
    segments = _history(history)
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
            warnings.simplefilter("ignore", UserWarning)  # Opacus' RDP grid-edge warning (domain size)
            epsilon = accountant.get_epsilon(delta=delta, eps_error=eps_error, delta_error=delta_error)
    except (RuntimeError, ValueError, FloatingPointError) as exc:
        raise PrivacyAccountingError(f"the PRV accountant failed ({exc}); use the 'rdp' accountant instead") from exc
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
        history=[(noise_multiplier, sample_rate, steps)], delta=delta, eps_error=eps_error, delta_error=delta_error
    )


# --- Noble, Bellet & Dieuleveut ------------------------------------------------------


def _log_binom(n: int, k: np.ndarray | int) -> np.ndarray:
    from scipy.special import gammaln  # imported here: scipy.special costs 0.1-0.2 s to import

    log_binom: np.ndarray = gammaln(n + 1) - gammaln(np.asarray(k) + 1) - gammaln(n - np.asarray(k) + 1)
    return log_binom


def wbk_subsampled_log_moment(*, order: int, ratio: float, base_rdp: Callable[[int], float] | np.ndarray) -> float:
    """Log-moment bound of a mechanism subsampled without replacement (WBK19, Thm 9).

    For an integer ``order`` >= 2, sampling ratio ``ratio`` and base RDP function
    ``base_rdp`` (a callable of the integer order, or an array indexed by it), returns

        log(1 + r^2 C(a,2) min{4(e^{e(2)} - 1), 2 e^{e(2)}} + sum_{j=3..a} 2 r^j C(a,j) e^{(j-1) e(j)})

    with the base mechanism's epsilon(infinity) taken as infinite (the Gaussian). The
    subsampled mechanism's RDP at this order is the result divided by (order - 1).
    Computed in log space, so large base RDP values do not overflow.
    """
    order = _count("order", order, minimum=2)
    ratio = _rate("ratio", ratio)
    js = np.arange(3, order + 1)
    if callable(base_rdp):
        eps2 = float(base_rdp(2))
        eps_j = np.array([float(base_rdp(int(j))) for j in js])
    else:
        eps2, eps_j = float(base_rdp[2]), np.asarray(base_rdp[3 : order + 1], dtype=float)
    if math.isinf(eps2) or np.isinf(eps_j).any():
        return math.inf
    log_ratio = math.log(ratio)
    # min{4(e^x - 1), 2e^x} in log space, with log(e^x - 1) = x + log(1 - e^-x) so that
    # large x cannot overflow; e^x - 1 = 0 when x = 0.
    log_expm1 = eps2 + math.log(-math.expm1(-eps2)) if eps2 > 0 else -math.inf
    log_second = min(math.log(4) + log_expm1, math.log(2) + eps2)
    terms = [0.0, 2 * log_ratio + float(_log_binom(order, 2)) + log_second]
    terms.extend(math.log(2) + js * log_ratio + _log_binom(order, js) + (js - 1) * eps_j)
    from scipy.special import logsumexp

    return float(logsumexp(terms))


def _noble_effective_noise(noise_multiplier: float, client_rate: float, clients: int, view: str) -> float:
    if view == "third-party":
        # l*M independent noises are averaged while one record's weight shrinks by 1/(lM).
        return noise_multiplier * math.sqrt(client_rate * clients)
    if view == "aggregator":  # whoever sees one client's individual update (a P2P neighbour)
        return noise_multiplier
    raise ConfigError("view", f"must be one of {', '.join(VIEWS)}, got {view!r}")


def _noble_curve(
    gaussian_rdp: np.ndarray, *, data_rate: float, local_steps: int, rounds: int, client_rate: float
) -> np.ndarray:
    """RDP of the nested mechanism at integer orders 0..len-1 (entries 0 and 1 are nan)."""
    max_order = len(gaussian_rdp) - 1
    inner = np.full(max_order + 1, np.nan)
    for a in range(2, max_order + 1):  # one round of one client: K steps at data ratio s
        inner[a] = local_steps * wbk_subsampled_log_moment(order=a, ratio=data_rate, base_rdp=gaussian_rdp) / (a - 1)
    outer = np.full(max_order + 1, np.nan)
    for a in range(2, max_order + 1):  # T rounds at client ratio l
        outer[a] = rounds * wbk_subsampled_log_moment(order=a, ratio=client_rate, base_rdp=inner) / (a - 1)
    return outer


def noble_rdp(
    *,
    noise_multiplier: float,
    data_rate: float,
    local_steps: int,
    rounds: int,
    client_rate: float,
    clients: int,
    view: str = "third-party",
    max_order: int = NOBLE_MAX_ORDER,
) -> np.ndarray:
    """RDP curve of the Noble et al. nested mechanism at integer orders ``0..max_order``.

    Entries 0 and 1 are nan. Curves of several segments add up order by order (RDP
    composition) before :func:`noble_privacy_spent`-style conversion. A
    ``noise_multiplier`` of ``math.inf`` gives the noise-independent floor.
    """
    noise_multiplier = float(noise_multiplier)
    if not noise_multiplier > 0:
        raise ConfigError("noise_multiplier", f"must be > 0, got {noise_multiplier}")
    data_rate = _rate("data_rate", data_rate)
    client_rate = _rate("client_rate", client_rate)
    local_steps = _count("local_steps", local_steps)
    rounds = _count("rounds", rounds)
    clients = _count("clients", clients, minimum=1)
    max_order = _count("max_order", max_order, minimum=2)
    sigma = _noble_effective_noise(noise_multiplier, client_rate, clients, view)
    orders = np.arange(max_order + 1, dtype=float)
    gaussian = orders / (2 * sigma**2)  # RDP of the Gaussian mechanism, 0 for infinite noise
    return _noble_curve(gaussian, data_rate=data_rate, local_steps=local_steps, rounds=rounds, client_rate=client_rate)


def mironov_conversion(curve: np.ndarray, delta: float) -> tuple[float, int]:
    """(epsilon, order): min over integer orders a >= 2 of curve[a] + log(1/delta)/(a-1).

    The classic RDP conversion of Mironov 2017, as in the Noble et al. script;
    `curve[a]` is the RDP at integer order a (entries 0 and 1 are ignored).
    """
    if not np.any(curve[2:]):  # nothing released: no cost, whatever the conversion says
        return 0.0, 0
    orders = np.arange(len(curve), dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = curve + math.log(1 / delta) / (orders - 1)
    eps[:2] = np.inf
    best = int(np.argmin(eps))
    return float(eps[best]), best


def noble_privacy_spent(
    *,
    noise_multiplier: float,
    data_rate: float,
    local_steps: int,
    rounds: int,
    client_rate: float,
    clients: int,
    delta: float,
    view: str = "third-party",
    max_order: int = NOBLE_MAX_ORDER,
) -> tuple[float, int]:
    """(epsilon, best integer order) of the Noble et al. bound; see :func:`noble_epsilon`."""
    delta = _delta(delta)
    _positive("noise_multiplier", noise_multiplier)
    curve = noble_rdp(
        noise_multiplier=noise_multiplier,
        data_rate=data_rate,
        local_steps=local_steps,
        rounds=rounds,
        client_rate=client_rate,
        clients=clients,
        view=view,
        max_order=max_order,
    )
    return mironov_conversion(curve, delta)


def noble_epsilon(
    *,
    noise_multiplier: float,
    data_rate: float,
    local_steps: int,
    rounds: int,
    client_rate: float,
    clients: int,
    delta: float,
    view: str = "third-party",
    max_order: int = NOBLE_MAX_ORDER,
) -> float:
    """Epsilon of Noble, Bellet & Dieuleveut's bound for DP-FedAvg/SCAFFOLD (and P4).

    Each of T = `rounds` rounds samples a fraction l = `client_rate` of the M = `clients`
    clients without replacement; a sampled client takes K = `local_steps` Gaussian
    steps, each on a fraction s = `data_rate` of its data sampled without replacement.
    Theorem 9 of Wang, Balle & Kasiviswanathan bounds one step at ratio s (inside, K
    compositions) and one round at ratio l (outside, T compositions); the RDP is
    converted with eps(a) + log(1/delta)/(a-1) and minimised over integer orders
    2..`max_order`. The reference script's extra fractional-order grid only ever lands
    next to an integer and reports up to ~3e-3 more.

    `view` is who observes the noise: ``"third-party"`` (only the aggregate, effective
    multiplier sigma*sqrt(l*M), the paper's choice) or ``"aggregator"`` (individual
    updates, as a P2P neighbour sees them: sigma itself).

    Caution: the bound has a noise-independent floor (:func:`noble_epsilon_floor`),
    because the j >= 3 terms of Theorem 9 keep a factor 2 as sigma grows. Report a
    Gaussian-specific accountant (RDP or PRV) alongside it.
    """
    return noble_privacy_spent(
        noise_multiplier=noise_multiplier,
        data_rate=data_rate,
        local_steps=local_steps,
        rounds=rounds,
        client_rate=client_rate,
        clients=clients,
        delta=delta,
        view=view,
        max_order=max_order,
    )[0]


def noble_epsilon_floor(
    *,
    data_rate: float,
    local_steps: int,
    rounds: int,
    client_rate: float,
    delta: float,
    max_order: int = NOBLE_MAX_ORDER,
) -> float:
    """The Noble bound with infinite noise: no noise multiplier gets below this epsilon."""
    curve = noble_rdp(
        noise_multiplier=math.inf,
        data_rate=data_rate,
        local_steps=local_steps,
        rounds=rounds,
        client_rate=client_rate,
        clients=1,
        view="aggregator",
        max_order=max_order,
    )
    return mironov_conversion(curve, _delta(delta))[0]
