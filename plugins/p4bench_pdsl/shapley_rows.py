"""The coalitions' sums of candidate blocks on a buffer of rows that chains keep.

`p4bench_pdsl.shapley_linear` turns every candidate of an agent into one block, its
margins on Q, so that a coalition's model is right on a sample exactly where the sum of its
members' blocks has no negative class. The distinct coalitions come in chains (a coalition
but the first of a chain is its *parent* plus one member): Monte-Carlo orders are chains of
prefixes, exact Shapley's subsets a tree. Going size by size, a coalition extends its
parent's row of the buffer in place, so one step of every order of a chunk of agents is one
gather of blocks and one addition over a buffer of tens of rows, which stays in cache.

`plan_rows` assigns the rows once, on the host, for every agent (a few array operations per
size, not per agent); `correct_counts` runs a chunk of agents on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from p4bench.engine.training import Workspace

__all__ = ["RowPlan", "plan_rows", "correct_counts"]

FRESH, COPIED, EXTENDED, ROOT = range(4)  # how a coalition's row gets its sum


@dataclass(frozen=True)
class RowPlan:
    """Every distinct coalition's place (host arrays, (U,)): its size, its row among its
    agent's `capacity` rows, how the row gets its sum (`kind`), the parent's row (for
    COPIED) and the block added (the member's slot). `members` (U, K) only where some
    coalition of two or more members has no parent (ROOT: summed from its members)."""

    agent: np.ndarray
    size: np.ndarray
    row: np.ndarray
    kind: np.ndarray
    source: np.ndarray
    member: np.ndarray
    members: np.ndarray | None
    capacity: int


def plan_rows(
    agent: np.ndarray,
    size: np.ndarray,
    parent: np.ndarray,
    added: np.ndarray,
    members: np.ndarray | None,
    num_agents: int,
) -> RowPlan:
    """Rows for the distinct coalitions (sorted by agent; `parent` an index among them or
    -1, `added` the member added to it; `members` needed where a coalition has no parent).

    Size by size: of each parent's children the first keeps its row and extends it, the
    others take free rows of their agent and a copy of it; coalitions of one member, or
    without a parent, take free rows. A row is free unless a coalition of the size below
    holding it has a child (which keeps it). An agent needs as many rows as its largest size
    has coalitions."""
    count, largest = len(agent), int(size.max(initial=0))
    nonempty = size > 0
    capacity = (
        int(np.bincount(agent[nonempty] * (largest + 1) + size[nonempty]).max())
        if nonempty.any()
        else 1
    )
    row = np.full(count, -1, dtype=np.int64)
    kind = np.full(count, FRESH, dtype=np.int8)
    source = np.full(count, -1, dtype=np.int64)
    member = added.copy()
    order = np.argsort(size, kind="stable")  # sizes ascending, agents ascending within a size
    bounds = np.searchsorted(size[order], np.arange(largest + 2))
    for length in range(1, largest + 1):
        level = order[bounds[length] : bounds[length + 1]]
        if not len(level):
            continue
        above = parent[level]
        keep = np.zeros(len(level), dtype=bool)
        if length > 1:
            linked = np.flatnonzero(above >= 0)
            _, first = np.unique(above[linked], return_index=True)
            keep[linked[first]] = True  # one child per parent keeps its row
            kind[level] = np.where(above >= 0, COPIED, ROOT)
            kind[level[keep]] = EXTENDED
            source[level] = np.where(above >= 0, row[np.maximum(above, 0)], -1)
        elif members is not None and bool(
            (above < 0).any()
        ):  # one member without the empty coalition requested
            single = level[above < 0]
            member[single] = members[single].argmax(axis=1)
        row[level[keep]] = row[above[keep]]
        taken = np.zeros((num_agents, capacity), dtype=bool)
        taken[agent[level[keep]], row[level[keep]]] = True
        others = level[~keep]
        owner = agent[others]
        rank = np.arange(len(others)) - np.searchsorted(
            owner, owner
        )  # the k-th coalition of its agent here
        free = np.argsort(taken, axis=1, kind="stable")  # each agent's free rows first, ascending
        row[others] = free[owner, rank]
    if members is None and bool(((kind == ROOT) & (size > 0)).any()):
        raise ValueError("coalitions without a parent need their members")
    return RowPlan(agent, size, row, kind, source, member, members, capacity)


def correct_counts(
    flat: torch.Tensor,
    samples: int,
    plan: RowPlan,
    lo: int,
    hi: int,
    first_agent: int,
    agents: int,
    slots: int,
    workspace: Workspace,
) -> torch.Tensor:
    """(hi - lo,) float64 on the device: for the coalitions lo..hi (those of the agents
    first_agent .. first_agent + agents), the samples (of `samples`) on which the sum of
    their members' blocks has no negative class. `flat` (agents K, L samples) holds the
    chunk's blocks, one contiguous row each. Empty coalitions count 0. The buffers come from
    `workspace`, reused by every chunk of a call (a fresh allocation of megabytes costs its
    page faults again, as much as the work on it)."""
    device = flat.device
    buffer_rows = agents * plan.capacity
    sums = workspace.get("shapley.sums", (buffer_rows, flat.shape[1]), flat.dtype, device=device)
    picked = workspace.get(
        "shapley.picked", (buffer_rows, flat.shape[1]), flat.dtype, device=device
    )
    span = slice(lo, hi)
    # the chunk's coalitions sorted by size, then by how their rows get their sums: each
    # (size, kind) is one range, and every index goes to the device once
    order = np.lexsort((plan.kind[span], plan.size[span]))
    size, kind = plan.size[span][order], plan.kind[span][order]
    local_agent = plan.agent[span][order] - first_agent
    row = local_agent * plan.capacity + plan.row[span][order]
    indices = {
        name: _index(values, device)
        for name, values in (
            ("row", row),
            ("source", local_agent * plan.capacity + plan.source[span][order]),
            ("block", local_agent * slots + plan.member[span][order]),
        )
    }
    largest = int(size.max(initial=0))
    bounds = np.searchsorted(size * 4 + kind, np.arange(4 * (largest + 1) + 1)).tolist()
    counts = flat.new_zeros(largest + 1, buffer_rows)  # (size, row): size 0's stay 0
    slot = np.zeros(
        hi - lo, dtype=np.int64
    )  # where each coalition's count lies in the (size, row) grid
    for length in range(1, largest + 1):
        start, end = bounds[4 * length], bounds[4 * length + 4]
        if start == end:
            continue
        ranges = [
            slice(bounds[4 * length + k], bounds[4 * length + k + 1])
            for k in (FRESH, COPIED, EXTENDED, ROOT)
        ]
        roots = ranges[ROOT]
        members = None
        if roots.stop > roots.start:
            assert plan.members is not None  # `plan_rows` refuses roots without members
            members = (plan.members[span][order][roots], local_agent[roots] * slots)
        _sum_level(sums, picked, flat, indices, ranges, members)
        if (
            2 * (end - start) >= buffer_rows
        ):  # most rows hold this size: the minima of all, no gather
            chosen, slot[order[start:end]] = sums, length * buffer_rows + row[start:end]
        else:
            chosen = sums.index_select(0, indices["row"][start:end])
            slot[order[start:end]] = length * buffer_rows + np.arange(end - start)
        mins = workspace.get("shapley.mins", (len(chosen), samples), flat.dtype, device=device)
        torch.amin(chosen.view(len(chosen), -1, samples), dim=1, out=mins)
        torch.sum(
            mins.ge_(0), dim=1, out=counts[length, : len(chosen)]
        )  # floats: exact below 2^24 samples
    return counts.view(-1)[_index(slot, device)].double()


def _sum_level(
    sums: torch.Tensor,
    picked: torch.Tensor,
    flat: torch.Tensor,
    indices: dict[str, torch.Tensor],
    ranges: list[slice],
    members: tuple[np.ndarray, np.ndarray] | None,
) -> None:
    """One size's sums: fresh rows take their block, copied rows their parent's row plus
    their block (before the parent's row is extended in place by its first child), roots
    the sum of their members' blocks (`members`: who, and their agent's first block)."""
    row, source, block = indices["row"], indices["source"], indices["block"]
    fresh, copied, extended, roots = ranges
    if fresh.stop > fresh.start:
        sums.index_copy_(0, row[fresh], flat.index_select(0, block[fresh]))
    if copied.stop > copied.start:
        parent_sums = sums.index_select(0, source[copied]).add_(flat.index_select(0, block[copied]))
        sums.index_copy_(0, row[copied], parent_sums)
    if extended.stop > extended.start:
        out = picked[: extended.stop - extended.start]
        sums.index_add_(0, row[extended], torch.index_select(flat, 0, block[extended], out=out))
    if members is not None:
        held, first_block = members
        root_rows = row[roots]
        sums.index_fill_(0, root_rows, 0.0)
        for slot in range(held.shape[1]):  # a loop over neighbourhood slots, not agents
            holding = np.flatnonzero(held[:, slot])
            if len(holding):
                where = torch.from_numpy(holding).to(root_rows.device)
                sums.index_add_(
                    0,
                    root_rows[where],
                    flat.index_select(0, _index(first_block[holding] + slot, flat.device)),
                )


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)
