"""The nested bound of Noble, Bellet & Dieuleveut (2022), used by the P4 paper to calibrate
noise: subsampling without replacement (Wang, Balle & Kasiviswanathan 2019, Theorem 9)
applied to the data ratio inside a round and to the client ratio outside, then the classic
RDP conversion (Mironov). Pure functions with keyword-only arguments, as the rest of
`p4bench.privacy.analysis`; invalid numbers raise `ConfigError` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from p4bench.errors import ConfigError
from p4bench.privacy.analysis import (
    NOBLE_MAX_ORDER,
    VIEWS,
    check_count,
    check_delta,
    check_positive,
    check_rate,
)

__all__ = [
    "mironov_conversion",
    "noble_epsilon",
    "noble_epsilon_floor",
    "noble_privacy_spent",
    "noble_rdp",
    "wbk_subsampled_log_moment",
]


def _log_binom(n: int, k: np.ndarray | int) -> np.ndarray:
    from scipy.special import gammaln  # imported here: scipy.special costs 0.1-0.2 s to import

    log_binom: np.ndarray = (
        gammaln(n + 1) - gammaln(np.asarray(k) + 1) - gammaln(n - np.asarray(k) + 1)
    )
    return log_binom


def wbk_subsampled_log_moment(
    *, order: int, ratio: float, base_rdp: Callable[[int], float] | np.ndarray
) -> float:
    """Log-moment bound of a mechanism subsampled without replacement (WBK19, Thm 9).

    For an integer ``order`` >= 2, sampling ratio ``ratio`` and base RDP function
    ``base_rdp`` (a callable of the integer order, or an array indexed by it), returns

        log(1 + r^2 C(a,2) min{4(e^{e(2)} - 1), 2 e^{e(2)}} + sum_{j=3..a} 2 r^j C(a,j) e^{(j-1) e(j)})

    with the base mechanism's epsilon(infinity) taken as infinite (the Gaussian). The
    subsampled mechanism's RDP at this order is the result divided by (order - 1).
    Computed in log space, so large base RDP values do not overflow.
    """
    order = check_count("order", order, minimum=2)
    ratio = check_rate("ratio", ratio)
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


def _noble_effective_noise(
    noise_multiplier: float, client_rate: float, clients: int, view: str
) -> float:
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
        inner[a] = (
            local_steps
            * wbk_subsampled_log_moment(order=a, ratio=data_rate, base_rdp=gaussian_rdp)
            / (a - 1)
        )
    outer = np.full(max_order + 1, np.nan)
    for a in range(2, max_order + 1):  # T rounds at client ratio l
        outer[a] = (
            rounds * wbk_subsampled_log_moment(order=a, ratio=client_rate, base_rdp=inner) / (a - 1)
        )
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
    data_rate = check_rate("data_rate", data_rate)
    client_rate = check_rate("client_rate", client_rate)
    local_steps = check_count("local_steps", local_steps)
    rounds = check_count("rounds", rounds)
    clients = check_count("clients", clients, minimum=1)
    max_order = check_count("max_order", max_order, minimum=2)
    sigma = _noble_effective_noise(noise_multiplier, client_rate, clients, view)
    orders = np.arange(max_order + 1, dtype=float)
    gaussian = orders / (2 * sigma**2)  # RDP of the Gaussian mechanism, 0 for infinite noise
    return _noble_curve(
        gaussian,
        data_rate=data_rate,
        local_steps=local_steps,
        rounds=rounds,
        client_rate=client_rate,
    )


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
    delta = check_delta(delta)
    check_positive("noise_multiplier", noise_multiplier)
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
    return mironov_conversion(curve, check_delta(delta))[0]
