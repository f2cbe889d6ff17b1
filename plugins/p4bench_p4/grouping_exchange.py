"""P4's phase-1 messages (Algorithm 1), as a mixin of `P4`: every client probes H sampled
peers with its DP-trained proxy and measures the L1 dissimilarity of what it receives
(`probe`), then shares its measurements with every client (`share`); each assembles the
dissimilarity matrix and runs the same deterministic grouping on it with the run's public
stream (`p4bench_p4.grouping`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray

from p4bench.engine import Messages
from p4bench.engine.messages import BROADCAST, UPDATE_PREFIX
from p4bench.engine.state import State, flatten, strip_prefix, vectorize
from p4bench_p4.grouping import form_groups, random_groups

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.method import StepContext

__all__ = ["UNKNOWN", "GroupingExchanges", "group_labels"]

UPDATE = UPDATE_PREFIX
PUBLIC_SEED = 13  # stream for the grouping's random pairs, shared by every client
UNKNOWN = (
    -1.0
)  # a distance not (yet) measured, in the state and on the wire (every value sent is finite)


class GroupingExchanges:
    """The `probe` and `share` exchanges of P4's grouping phase (`outgoing` and `receive`
    dispatch to `_send_<exchange>` and `_receive_<exchange>`). Uses the method's
    `num_clients`, `samples` (H), `group_size`, `grouping` mode and `config.seed`."""

    num_clients: int
    samples: int
    group_size: int
    grouping: str
    config: RunConfig

    def _send_probe(self, state: State, ctx: StepContext) -> Messages:
        """Send the phase-1 proxy to H peers sampled from the client's own stream."""
        count = len(ctx.rows)
        others = torch.full((count,), self.num_clients - 1)
        picks, _ = ctx.rng.subsets(others, torch.full((count,), self.samples), self.samples)
        peers = picks + (picks >= ctx.rows.unsqueeze(1)).long()  # skip oneself
        src = ctx.rows.repeat_interleave(self.samples)
        shared = torch.arange(count).repeat_interleave(self.samples)  # one stored copy per sender
        return Messages(src, peers.reshape(-1), flatten(state["proxy"], UPDATE), shared)

    def _receive_probe(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        """Measure L1 dissimilarity between one's own proxy and each received one."""
        if not len(inbox):  # every sampled peer failed (device runtime)
            return state
        position = torch.searchsorted(ctx.rows, inbox.dst)
        own = vectorize(state["proxy"])
        theirs = vectorize(strip_prefix(inbox.table, UPDATE))
        rows = inbox.table_rows()
        distance = torch.empty(len(inbox))
        chunk = max(1, (1 << 24) // max(own.shape[1], 1))  # bound each temporary to ~64 MB
        for start in range(0, len(inbox), chunk):
            part = slice(start, start + chunk)
            distance[part] = (own[position[part]] - theirs[rows[part]]).abs().sum(dim=1)
        known = state["known"].clone()
        known[position, inbox.src] = distance
        return {**state, "known": known}

    def _send_share(self, state: State, ctx: StepContext) -> Messages:
        """Every client shares what it measured with every other client: one broadcast
        (one message per receiver on a real network, one stored message in the simulator)."""
        # the state's own tensor: it is never changed in place (the probe writes a copy)
        return Messages(ctx.rows, torch.full_like(ctx.rows, BROADCAST), {"known": state["known"]})

    def _receive_share(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        rows = ctx.rows.tolist()
        # grouping runs on the host: each row's group, written back to the state in one copy
        assigned = np.zeros((len(rows), self.num_clients), dtype=bool)
        found = np.zeros(len(rows), dtype=bool)
        seen, label = None, np.zeros(0, dtype=np.int64)
        for position, matrix in self._assembled_views(state, inbox, ctx):
            if (
                matrix is not seen
            ):  # usually one matrix for every row: group (and copy to the host) once
                seen, label = matrix, group_labels(self._groups(matrix), self.num_clients)
            own = label[rows[position]]
            if own >= 0:  # O(M) per row: no search through the groups
                assigned[position] = label == own
                found[position] = True
        members, device = state["members"], state["members"].device
        members = torch.where(
            torch.from_numpy(found).to(device).unsqueeze(1),
            torch.from_numpy(assigned).to(device),
            members,
        )
        return {**state, "members": members}

    def _assembled_views(
        self, state: State, inbox: Messages, ctx: StepContext
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (row position, dissimilarity matrix) as each client assembles it from
        its own measurements and what it received. When every client received the same
        shares from everyone (the usual case), they all see one matrix: build it once."""
        rows = ctx.rows
        matrix = self._common_view(state, inbox, rows)
        if matrix is not None:
            for position in range(len(rows)):
                yield position, matrix
            return
        if bool(
            inbox.is_broadcast().any()
        ):  # some clients did not broadcast (or more than once): per receiver
            inbox = inbox.expand_broadcasts(self.num_clients)
            inbox = inbox.select(torch.isin(inbox.dst, rows)).sorted()
        for position, client in enumerate(rows.tolist()):
            mine = inbox.select(inbox.dst == client)
            matrix = torch.full((self.num_clients, self.num_clients), UNKNOWN)
            if len(mine):  # shares of peers that failed stay unknown
                matrix[mine.src] = mine.value("known")
            matrix[client] = state["known"][position]
            yield position, matrix

    def _common_view(
        self, state: State, inbox: Messages, rows: torch.Tensor
    ) -> torch.Tensor | None:
        """The one matrix every held row sees when each received every other client's share
        once and all shares agree; else None. A held client's row is its own measurements."""
        wide = inbox.is_broadcast()
        if (
            bool(wide.all())
            and len(inbox) == self.num_clients
            and torch.equal(
                torch.sort(inbox.src).values,
                torch.arange(self.num_clients, device=inbox.src.device),
            )
        ):
            if (
                len(rows) == self.num_clients
            ):  # the simulator: every row is held, the state is the matrix
                known: torch.Tensor = state["known"]
                return known
            matrix = inbox.value("known")[torch.argsort(inbox.src)]
        else:
            if len(rows) < 2 or bool(wide.any()):
                return None
            received = (
                torch.bincount(torch.searchsorted(rows, inbox.dst), minlength=len(rows))
                if len(inbox)
                else torch.zeros(len(rows))
            )
            if not bool((received == self.num_clients - 1).all()):
                return None
            positions = torch.arange(len(inbox))
            first = torch.full((self.num_clients,), len(inbox), dtype=torch.long).scatter_reduce(
                0, inbox.src, positions, reduce="amin"
            )
            if not (bool((first < len(inbox)).all()) and same_as_first(inbox, "known", first)):
                return None
            matrix = inbox.table["known"][
                inbox.table_rows()[first]
            ]  # O(M^2): the senders' rows, never one per message
        matrix[rows] = state["known"]
        return matrix

    def _groups(self, matrix: torch.Tensor) -> list[list[int]]:
        host = matrix.cpu().numpy()  # grouping is host-side numpy (one read of an M x M matrix)
        return cached_groups(
            hashlib.sha256(np.ascontiguousarray(host).data).hexdigest(),
            host,
            self.group_size,
            self.config.seed,
            self.grouping,
        )


def same_as_first(inbox: Messages, key: str, first: torch.Tensor) -> bool:
    """Whether every message's `key` row equals that of its sender's first message
    (`first`: inbox position per sender). Messages that carry the very table row of that
    first message (the simulator's: a sender's share is stored once) are equal without a
    look; the others are compared in chunks, so no (messages x M) copy is made."""
    table, rows = inbox.table[key], inbox.table_rows()
    reference = rows[first[inbox.src]]
    differ = (reference != rows).nonzero().squeeze(1)
    chunk = max(1, (1 << 24) // max(table.shape[1], 1))
    for start in range(0, len(differ), chunk):
        part = differ[start : start + chunk]
        if not torch.equal(table[rows[part]], table[reference[part]]):
            return False
    return True


def group_labels(groups: list[list[int]], count: int) -> NDArray[np.int64]:
    """(count,) each client's group index, -1 for a client in no group."""
    label = np.full(count, -1, dtype=np.int64)
    for index, group in enumerate(groups):
        label[np.asarray(group, dtype=np.int64)] = index
    return label


@lru_cache(maxsize=64)
def group_cache(digest: str, group_size: int, seed: int, mode: str) -> tuple[tuple[int, ...], ...]:
    matrix = PENDING.pop(digest)
    rng = np.random.default_rng(np.random.SeedSequence([seed, PUBLIC_SEED]))
    count = len(matrix)
    groups = (
        form_groups(matrix, group_size, rng)
        if mode == "similarity"
        else random_groups(count, group_size, rng)
    )
    return tuple(tuple(g) for g in groups)


PENDING: dict[str, np.ndarray] = {}


def cached_groups(
    digest: str, matrix: np.ndarray, group_size: int, seed: int, mode: str
) -> list[list[int]]:
    """Grouping is a pure function of its inputs; identical inputs are computed once."""
    PENDING[digest] = matrix
    try:
        return [list(g) for g in group_cache(digest, group_size, seed, mode)]
    finally:
        PENDING.pop(digest, None)
