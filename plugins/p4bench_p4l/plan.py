"""Public draws of P4L: which peers initiate synergies, their sizes, successor choice at
each hop and the fault injector's drops and crashes.

None of these draws touches data or secrets (who initiates and who joins is visible in
the protocol anyway), so they come from streams keyed by the run seed and the event
(round, synergy, hop, tick, peer): every runtime, and every peer process on devices,
makes exactly the same choices, and the simulator and the device runtime run the same
synergies.

Peer selection (initiators and successors): uniform, P_i = 1/M, or the paper's power law
f(x, a) = a x^(a-1) on [0, 1] with a = 2. The paper does not say how x maps to peers
(erratum A5): peer i (in id order) gets the mass of [i/M, (i+1)/M], that is
((i+1)/M)^a - (i/M)^a, so higher ids are drawn more often. Synergy sizes: `fixed`, or the
same power law over [size_min, size_max] (sz = size_min + floor(x (size_max - size_min + 1))).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from p4bench.engine.method_kit import power_law_weights

POWER_LAW_A = 2.0
LAWS = ("uniform", "powerlaw")
SIZE_LAWS = ("fixed", "powerlaw")

# stream tags: one family per kind of draw
_PLAN, _SUCCESSOR, _DROP, _CRASH = 1, 2, 3, 4
_TAG = 0x504C34  # "P4L"


def _rng(seed: int, *event: int) -> np.random.Generator:
    return np.random.default_rng([_TAG, int(seed), *(int(e) for e in event)])


def law_weights(law: str, count: int, a: float = POWER_LAW_A) -> np.ndarray:
    """(count,) selection probabilities of peers 0..count-1."""
    if law == "uniform":
        return np.full(count, 1.0 / count)
    return power_law_weights(count, a)


@dataclass(frozen=True)
class SynergyPlan:
    """One synergy of a round: its id, initiator, size (members, the initiator included),
    whether its initiator crashes right after sending the token, and its deadline in ticks."""

    id: int
    initiator: int
    size: int
    crash: bool
    deadline: int


@dataclass(frozen=True)
class PlanSettings:
    """The options the draws depend on (`P4L.validate_options` builds it)."""

    seed: int
    num_peers: int
    synergies: int
    size: int
    size_min: int
    size_max: int
    size_law: str
    peer_law: str
    retries: int
    drop_prob: float
    crash_prob: float
    global_timeout: int | None

    @property
    def largest(self) -> int:
        """The largest synergy a round can hold (never more members than peers)."""
        top = self.size if self.size_law == "fixed" else self.size_max
        return min(top, self.num_peers)

    @property
    def ticks(self) -> int:
        """Hop ticks per round: enough for the largest synergy's deadline."""
        return (
            self.global_timeout if self.global_timeout is not None else self.largest + self.retries
        )

    def deadline(self, size: int) -> int:
        """Ticks by which the final message must reach the initiator: a fault-free chain of
        `size` members needs `size` ticks (size - 1 hops and the final one); R more ticks
        leave room for R retries. The paper's t_p (S - 1) is shorter than a fault-free
        chain under both readings of S (erratum A1): option `global_timeout` sets it."""
        return self.global_timeout if self.global_timeout is not None else size + self.retries


def round_plan(settings: PlanSettings, round_index: int) -> list[SynergyPlan]:
    """The synergies started in `round_index`: distinct initiators drawn by the peer law."""
    rng = _rng(settings.seed, _PLAN, round_index)
    count = min(settings.synergies, settings.num_peers)
    initiators = rng.choice(
        settings.num_peers,
        size=count,
        replace=False,
        p=law_weights(settings.peer_law, settings.num_peers),
    )
    plans = []
    for index, initiator in enumerate(initiators.tolist()):
        if settings.size_law == "fixed":
            size = settings.size
        else:
            x = rng.random() ** (1.0 / POWER_LAW_A)  # inverse CDF of a x^(a-1)
            size = settings.size_min + min(
                int(x * (settings.size_max - settings.size_min + 1)),
                settings.size_max - settings.size_min,
            )
        size = min(size, settings.num_peers)
        crash = bool(_rng(settings.seed, _CRASH, round_index, index).random() < settings.crash_prob)
        plans.append(
            SynergyPlan(
                round_index * 10_000 + index, int(initiator), size, crash, settings.deadline(size)
            )
        )
    return plans


def choose_successor(
    settings: PlanSettings,
    synergy: int,
    hop: int,
    attempt: int,
    holder: int,
    excluded: Iterable[int],
    reachable: np.ndarray,
) -> int | None:
    """The peer `holder` sends the token to: drawn by the peer law among the peers it can
    reach (`reachable` (M,) bool, the proximity set) outside `excluded` (the members L and
    peers already tried for this hop); None when nobody is left."""
    allowed = reachable.copy()
    allowed[holder] = False
    allowed[[e for e in excluded if 0 <= e < len(allowed)]] = False
    if not allowed.any():
        return None
    weights = law_weights(settings.peer_law, settings.num_peers) * allowed
    rng = _rng(settings.seed, _SUCCESSOR, synergy, hop, attempt, holder)
    return int(rng.choice(settings.num_peers, p=weights / weights.sum()))


def dropped(settings: PlanSettings, synergy: int, tick: int, receiver: int) -> bool:
    """Whether `receiver` is out of reach when the token of `synergy` arrives at `tick`
    (churn: it neither adds its model nor answers with a beacon)."""
    if settings.drop_prob <= 0:
        return False
    return bool(_rng(settings.seed, _DROP, synergy, tick, receiver).random() < settings.drop_prob)
