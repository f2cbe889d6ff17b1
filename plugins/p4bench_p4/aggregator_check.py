"""How P4's members hold their group's aggregator to the protocol (option `aggregator_check`).

The paper trusts each round's aggregator wholesale: whoever announces is followed, and
the model it distributes becomes every member's proxy. One compromised member then rules
its group whenever its turn comes (issue #47: a negated `distribute` took the group's
proxy accuracy from 0.771 to 0.000, nothing rejected). The checks, by mode:

- ``turn``: a member follows only an announcer whose turn it is by the schedule every
  member computes (round-robin over the sorted members, skipping members it saw fail on
  the device runtime: either view counts, so a takeover after a fault is still
  followed). Other announcers, and `distribute` senders that are neither the followed
  aggregator nor a scheduled one, are rejected and named.
- ``recompute`` (default), also: participants send their proxy delta to every member, not
  only to the aggregator, and every member aggregates what it received exactly as the
  aggregator does (the run's defense, eta_g). A distributed model that differs from the
  member's own aggregate is rejected, the aggregator named, and the member keeps its own.
  Nothing new is released: the deltas are the DP releases the ledger already counts, sent
  to more members of the same group; the aggregate is their post-processing. The
  aggregator adds no noise (the paper noises the local steps only), so honest results
  agree to floating-point order (`aggregator_tolerance`).
- ``none``: the paper's protocol.

Works alike in the simulator and on devices, where each member sees only its own inbox:
every check reads what the member itself received and the schedule it computes itself.
"""

from __future__ import annotations

import torch

from p4bench.engine import Messages
from p4bench.engine.state import State

__all__ = [
    "AGGREGATE_MISMATCH",
    "NON_MEMBER_UPLOAD",
    "OUT_OF_TURN_ANNOUNCE",
    "OUT_OF_TURN_DISTRIBUTE",
    "group_members_of",
    "in_turn",
    "matches_aggregate",
    "scheduled_turn",
]

# rejection reasons, reported as "rejected <reason> from <id>"
OUT_OF_TURN_ANNOUNCE = "out-of-turn announce"
OUT_OF_TURN_DISTRIBUTE = "out-of-turn distribute"
NON_MEMBER_UPLOAD = "upload from a non-member"
AGGREGATE_MISMATCH = "aggregate mismatch"  # the distributed model is not the member's own aggregate


def scheduled_turn(sorted_ids: torch.Tensor, round_index: int) -> torch.Tensor:
    """(C,) the plain round-robin aggregator of each row's group (no member skipped), from
    the rows' sorted member ids (C, V) padded with -1."""
    size = (sorted_ids >= 0).sum(dim=1).clamp_min(1)
    return sorted_ids.gather(1, (round_index % size).unsqueeze(1)).squeeze(1)


def in_turn(
    inbox: Messages, position: torch.Tensor, expected: torch.Tensor, scheduled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, rejected): indices of the announcements whose sender is the receiving row's
    `expected` aggregator (its own view, failures skipped) or the `scheduled` one, ordered
    by row with the expected one first, so "first per row" follows it; and the mask of the
    others, out of turn. `position`: each message's row."""
    src = inbox.src
    wanted = src == expected[position]
    legit = wanted | (src == scheduled[position])
    kept = legit.nonzero().squeeze(1)
    # by row, the row's own expected aggregator first (stable: then by sender id)
    key = position[kept] * 2 + (~wanted[kept]).long()
    order = kept[torch.argsort(key, stable=True)]
    return order, ~legit


def matches_aggregate(
    distributed: torch.Tensor, recomputed: torch.Tensor, tolerance: float
) -> torch.Tensor:
    """(n,) bool: each distributed model (n, P) equals the member's own aggregate (n, P) up
    to `tolerance` times the aggregate's largest entry (floating-point order: the same
    computation on the same inputs, possibly batched differently)."""
    if len(distributed) == 0:
        return torch.zeros(0, dtype=torch.bool)
    scale = recomputed.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    gap = (distributed.double() - recomputed.double()).abs().amax(dim=1)
    # a NaN anywhere is a mismatch (the receive gate drops non-finite payloads already)
    return gap <= tolerance * scale.double()


def group_members_of(state: State, rows: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """(n,) bool: whether each sender `rows` is a member of the group of receiving row
    `position` (as that row knows it)."""
    members: torch.Tensor = state["members"]
    return members[position, rows.clamp_min(0)] & (rows >= 0)
