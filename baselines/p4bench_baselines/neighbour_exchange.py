"""The three exchanges cross-gradient methods share (PDSL, DP-CGA): models out, gradients
back, gossip; batched over all rows, with slot k of a row's (C, K, P) grid holding what
the neighbour in slot k of its `NeighbourTable` sent it (K the largest degree, so a
round costs the graph's edges, not M^2). What a peer sends is untrusted: senders outside
the receiver's neighbourhood are ignored."""

from __future__ import annotations

from typing import Any

import torch

from p4bench.engine import Messages
from p4bench.engine.state import vectorize
from p4bench_baselines.cross_gradients import GRADIENT, MODEL
from p4bench_baselines.neighbour_table import NeighbourTable


def neighbour_messages(
    exchange: str,
    state: dict[str, Any],
    rows: torch.Tensor,
    table: NeighbourTable,
    gossip: dict[str, torch.Tensor],
) -> Messages:
    """`models` (x_i to every neighbour), `gradients` (g_ij to j) or `gossip` (the `gossip`
    vectors, (C, P) each, to every neighbour); nothing is sent to oneself. Messages go
    by sender, then receiver id (the table's slot order)."""
    others = table.real[rows].clone()
    others[torch.arange(len(rows)), table.own[rows]] = False
    sender, slot = others.nonzero(as_tuple=True)
    receiver = table.ids[rows[sender], slot]
    if exchange == "models":
        return Messages(rows[sender], receiver, {MODEL: vectorize(state["params"])}, rows=sender)
    if exchange == "gradients":
        return Messages(rows[sender], receiver, {GRADIENT: state["cross"][sender, slot]})
    if exchange == "gossip":
        return Messages(rows[sender], receiver, gossip, rows=sender)
    return Messages.empty()


def neighbour_grid(
    inbox: Messages, rows: torch.Tensor, key: str, width: int, table: NeighbourTable
) -> torch.Tensor:
    """(C, K, P): slot k of row i holds what its neighbour in slot k sent i (zeros elsewhere)."""
    grid = torch.zeros(len(rows), table.width, width)
    if not len(inbox):
        return grid
    position = torch.searchsorted(rows, inbox.dst)
    slot, valid = table.slot_of(inbox.dst, inbox.src)
    grid[position[valid], slot[valid]] = inbox.value(key)[valid].to(grid.dtype)
    return grid


def received_gradients(
    inbox: Messages, state: dict[str, Any], rows: torch.Tensor, table: NeighbourTable
) -> torch.Tensor:
    """(C, K, P): g_ji from each neighbour j, and the row's own g_ii in its own slot."""
    grid = neighbour_grid(inbox, rows, GRADIENT, state["cross"].shape[2], table)
    mine, own = torch.arange(len(rows)), table.own[rows]
    grid[mine, own] = state["cross"][mine, own]
    return grid


def gossip_mix(
    inbox: Messages, rows: torch.Tensor, table: NeighbourTable, own: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """sum_j w_ij v_j for each gossiped key, the row's own value `own[key]` in its slot
    (w_ij: the table's weights)."""
    w = table.weights[rows]
    mine, slot, out = torch.arange(len(rows)), table.own[rows], {}
    for key, value in own.items():
        grid = neighbour_grid(inbox, rows, key, value.shape[1], table)
        grid[mine, slot] = value.to(grid.dtype)
        out[key] = torch.bmm(w.to(grid.dtype).unsqueeze(1), grid).squeeze(1)
    return out
