"""Privacy accountant plugins: turn one client's record of noisy releases into epsilon.

An accountant is stateless. It receives the client's *history*, a list of
:class:`ReleaseSegment` (consecutive releases with the same parameters), and a delta.
The stateful per-client ledger that appends segments lives elsewhere; any registered
accountant can be plugged into it through the uniform :meth:`Accountant.epsilon`.

Two kinds of analysis are offered:

- ``rdp`` and ``prv`` account the Poisson-subsampled Gaussian over the steps the
  client actually took (``ReleaseSegment.steps``). They take no amplification from
  client sampling: which rounds a client joins is treated as public, which is the
  right model for a P2P neighbour who sees the client's messages.
- ``pld`` (:mod:`p4bench.privacy.pld`) composes privacy-loss distributions of the same
  mechanism with Google's dp-accounting, for add-remove and replace-one natively.
- ``noble`` is the nested bound used by the P4 paper (client ratio outside, data ratio
  inside); it reads ``rounds``, ``local_steps``, ``client_rate``, ``clients`` and
  ``view`` and has a noise-independent floor.

Neighbouring relations: the noise multiplier of a history is measured against the
relation's sensitivity, std = sigma * C (add-remove) or sigma * 2C (replace-one).
:func:`accounted_epsilon` evaluates a history for a run's relation: natively where the
accountant supports it, otherwise by a sound conversion.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from p4bench.errors import ConfigError
from p4bench.options import Option
from p4bench.privacy import analysis, noble
from p4bench.privacy.analysis import VIEWS, check_count, check_delta, check_positive, check_rate

__all__ = [
    "ReleaseSegment",
    "Accountant",
    "RDPAccountant",
    "PRVAccountant",
    "NobleAccountant",
    "NEIGHBOURING",
    "native_relations",
    "accounted_epsilon",
    "compact_history",
]

NEIGHBOURING = ("add-remove", "replace-one")
"""The neighbouring relations (the same names as ``p4bench.privacy.mechanism.NEIGHBOURING``)."""


@dataclass(frozen=True)
class ReleaseSegment:
    """Consecutive noisy releases of one client that share their parameters.

    Attributes:
        noise_multiplier: Gaussian noise std divided by the clipping norm (sigma).
        sample_rate: fraction of the client's records in each step's batch (q, or s).
        steps: noisy steps the client actually took in this segment (rdp, prv).
        local_steps: steps per round K (noble).
        rounds: rounds T in which the client could have been selected (noble); by
            default ``ceil(steps / local_steps)``, i.e. a client that joined every round.
        client_rate: fraction l of clients selected per round (noble).
        clients: number of clients M (noble, third-party view).
        view: ``"third-party"`` or ``"aggregator"`` (noble; see ``noble_epsilon``).
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    local_steps: int = 1
    rounds: int | None = None
    client_rate: float = 1.0
    clients: int = 1
    view: str = "third-party"

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        check_rate("sample_rate", self.sample_rate)
        check_count("steps", self.steps)
        check_count("local_steps", self.local_steps, minimum=1)
        if self.rounds is not None:
            check_count("rounds", self.rounds)
        check_rate("client_rate", self.client_rate)
        check_count("clients", self.clients, minimum=1)
        if self.view not in VIEWS:
            raise ConfigError("view", f"must be one of {', '.join(VIEWS)}, got {self.view!r}")

    @property
    def total_rounds(self) -> int:
        """T for the Noble bound: `rounds`, or the rounds needed for `steps`."""
        return self.rounds if self.rounds is not None else math.ceil(self.steps / self.local_steps)

    def as_opacus(self) -> tuple[float, float, int]:
        """The ``(noise_multiplier, sample_rate, steps)`` triple of Opacus histories."""
        return (self.noise_multiplier, self.sample_rate, self.steps)


def compact_history(history: Sequence[ReleaseSegment]) -> list[ReleaseSegment]:
    """Merge consecutive segments that differ only in `steps` and `rounds`.

    Accounting is unchanged; PRV in particular gets faster with fewer segments.
    """
    merged: list[ReleaseSegment] = []
    for segment in history:
        last = merged[-1] if merged else None
        if last is not None and replace(last, steps=0, rounds=None) == replace(
            segment, steps=0, rounds=None
        ):
            both_default = last.rounds is None and segment.rounds is None
            rounds = None if both_default else last.total_rounds + segment.total_rounds
            merged[-1] = replace(last, steps=last.steps + segment.steps, rounds=rounds)
        else:
            merged.append(segment)
    return merged


class Accountant(ABC):
    """Base of accountant plugins: a pure map from (history, delta) to epsilon.

    Subclasses set the class attributes `name` and `description` and are created
    without arguments. Keyword `context` carries accountant-specific knobs (for
    example ``eps_error`` for PRV); keys an accountant does not know are ignored, so a
    caller can pass the same context to any accountant.

    `relations` are the neighbouring relations the analysis is stated for natively,
    with the noise multiplier measured against that relation's sensitivity:
    ``"add-remove"`` (std = sigma * C) or ``"replace-one"`` (std = sigma * 2C). An
    accountant with several reads the one to analyse from ``context["neighbouring"]``
    (default: the first, also available as `relation`). A subclass may set either
    attribute; the other follows. `uses_rounds` says whether epsilon depends on the
    rounds offered (`ReleaseSegment.rounds`) and not only on the steps taken.
    `options` declares the run options (`config.options`) the accountant reads.
    `sampling` names the batch sampling schemes the analysis is proved for:
    ``"poisson"`` (each record independently, as private runs sample) or
    ``"fixed-size"`` (batches of fixed size drawn without replacement); a run whose
    sampling is not among them is reported uncertified (`p4bench.privacy.certification`).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    relation: ClassVar[str] = "add-remove"
    relations: ClassVar[tuple[str, ...]] = ("add-remove",)
    uses_rounds: ClassVar[bool] = False
    sampling: ClassVar[tuple[str, ...]] = ("poisson",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # keep the single-relation spelling (`relation = ...`) of older plugins working
        if "relations" in cls.__dict__:
            cls.relation = cls.relations[0]
        elif "relation" in cls.__dict__:
            cls.relations = (cls.relation,)

    @abstractmethod
    def epsilon(self, history: Sequence[ReleaseSegment], delta: float, **context: Any) -> float:
        """Epsilon at `delta` after every release in `history` (0.0 for no release)."""

    def epsilon_floor(
        self, history: Sequence[ReleaseSegment], delta: float, **context: Any
    ) -> float:
        """The epsilon this analysis reports for `history` however large the noise is."""
        return 0.0


class RDPAccountant(Accountant):
    """RDP of the Poisson-subsampled Gaussian over the steps a client took (Opacus)."""

    name = "rdp"
    description = "RDP of the Poisson-subsampled Gaussian (Opacus), Balle et al. 2020 conversion"

    def epsilon(self, history: Sequence[ReleaseSegment], delta: float, **context: Any) -> float:
        orders = context.get("orders")
        return analysis.rdp_epsilon_history(
            history=[s.as_opacus() for s in history], delta=delta, orders=orders
        )


class PRVAccountant(Accountant):
    """Numerical PRV composition of the Poisson-subsampled Gaussian (Opacus)."""

    name = "prv"
    description = (
        "PRV accountant of the Poisson-subsampled Gaussian (Opacus, Gopi et al. 2021), upper bound"
    )

    def epsilon(self, history: Sequence[ReleaseSegment], delta: float, **context: Any) -> float:
        return analysis.prv_epsilon_history(
            history=[s.as_opacus() for s in compact_history(history)],
            delta=delta,
            eps_error=context.get("eps_error", 0.01),
            delta_error=context.get("delta_error"),
        )


class NobleAccountant(Accountant):
    """Noble, Bellet & Dieuleveut's nested subsampling bound (as used by P4)."""

    name = "noble"
    description = "Noble et al. 2022 nested bound (client ratio outside, data ratio inside); has a noise floor"
    relations = ("replace-one",)  # subsampling without replacement (WBK19) and sensitivity 2C/b
    sampling = (
        "fixed-size",
    )  # WBK19's amplification by sampling batches of fixed size without replacement
    uses_rounds = True
    # read by the runner into every release segment's `view`
    options = (
        Option(
            "noble_view",
            str,
            "aggregator",
            "who observes the noise: aggregator (whoever sees one "
            "client's update, as a P2P neighbour) or third-party (only the aggregate)",
            choices=VIEWS,
        ),
    )

    def _curve(
        self, history: Sequence[ReleaseSegment], max_order: int, infinite_noise: bool
    ) -> np.ndarray:
        total = np.zeros(max_order + 1)
        for s in history:  # RDP composes order by order across segments
            total = total + noble.noble_rdp(
                noise_multiplier=math.inf if infinite_noise else s.noise_multiplier,
                data_rate=s.sample_rate,
                local_steps=s.local_steps,
                rounds=s.total_rounds,
                client_rate=s.client_rate,
                clients=s.clients,
                view=s.view,
                max_order=max_order,
            )
        return total

    def _spent(
        self, history: Sequence[ReleaseSegment], delta: float, infinite_noise: bool, **context: Any
    ) -> float:
        delta = check_delta(delta)
        if not any(s.total_rounds and s.local_steps for s in history):
            return 0.0
        max_order = int(context.get("max_order", analysis.NOBLE_MAX_ORDER))
        return noble.mironov_conversion(self._curve(history, max_order, infinite_noise), delta)[0]

    def epsilon(self, history: Sequence[ReleaseSegment], delta: float, **context: Any) -> float:
        return self._spent(history, delta, False, **context)

    def epsilon_floor(
        self, history: Sequence[ReleaseSegment], delta: float, **context: Any
    ) -> float:
        return self._spent(history, delta, True, **context)


def native_relations(accountant: Accountant) -> tuple[str, ...]:
    """The relations `accountant` analyses natively (duck-typed plugins: `relation`, else add-remove)."""
    return tuple(getattr(accountant, "relations", ())) or (
        getattr(accountant, "relation", "add-remove"),
    )


def accounted_epsilon(
    accountant: Accountant,
    history: Sequence[ReleaseSegment],
    delta: float,
    neighbouring: str,
    **context: Any,
) -> float:
    """Epsilon of `history` (segments carrying the run's sigma) for the run's relation.

    An accountant that supports `neighbouring` natively analyses it directly. Otherwise:
    a replace-one analysis (noble) of an add-remove run reads sigma / 2 (std / (2C));
    an add-remove analysis (rdp, prv) of a replace-one run analyses multiplier 2 sigma
    (std / C) and converts soundly by group privacy: a replacement is a removal then
    an addition, so (eps, delta') for add-remove gives (2 eps, delta' (1 + e^eps)).
    """
    if neighbouring not in NEIGHBOURING:
        raise ConfigError(
            "neighbouring", f"must be one of {', '.join(NEIGHBOURING)}, got {neighbouring!r}"
        )
    if not history:
        return 0.0
    native = native_relations(accountant)
    if neighbouring in native:
        return accountant.epsilon(history, delta, **{**context, "neighbouring": neighbouring})
    if "replace-one" in native:  # add-remove run, replacement analysis: std / (2C) = sigma / 2
        halved = [replace(s, noise_multiplier=0.5 * s.noise_multiplier) for s in history]
        return accountant.epsilon(halved, delta, **{**context, "neighbouring": "replace-one"})
    doubled = [replace(s, noise_multiplier=2.0 * s.noise_multiplier) for s in history]
    context = {**context, "neighbouring": "add-remove"}
    inner_delta = delta / 2.0
    for _ in range(30):  # fixed point of delta' = delta / (1 + e^eps(delta')), from above
        eps = accountant.epsilon(doubled, inner_delta, **context)
        next_delta = delta / (1.0 + math.exp(min(eps, 700.0)))
        if abs(next_delta - inner_delta) <= 1e-3 * next_delta:
            inner_delta = min(inner_delta, next_delta)
            break
        inner_delta = next_delta
    return 2.0 * accountant.epsilon(doubled, inner_delta, **context)
