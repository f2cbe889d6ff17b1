"""The three exchanges cross-gradient methods share (PDSL, DP-CGA): models out, gradients
back, gossip; batched over all rows, with slot j of a row's (C, M, P) grid holding what
neighbour j sent it. What a peer sends is untrusted: senders outside the receiver's
neighbourhood are ignored."""

from __future__ import annotations

from typing import Any

import torch

from p4bench.baselines.cross_gradients import GRADIENT, MODEL
from p4bench.engine import Messages
from p4bench.engine.state import vectorize


def neighbour_messages(exchange: str, state: dict[str, Any], rows: torch.Tensor, members: torch.Tensor,
                       gossip: dict[str, torch.Tensor]) -> Messages:
    """`models` (x_i to every neighbour), `gradients` (g_ij to j) or `gossip` (the `gossip`
    vectors, (C, P) each, to every neighbour); nothing is sent to oneself."""
    present = members[rows].clone()
    present[torch.arange(len(rows)), rows] = False
    sender, receiver = present.nonzero(as_tuple=True)
    if exchange == "models":
        return Messages(rows[sender], receiver, {MODEL: vectorize(state["params"])}, rows=sender)
    if exchange == "gradients":
        return Messages(rows[sender], receiver, {GRADIENT: state["cross"][sender, receiver]})
    if exchange == "gossip":
        return Messages(rows[sender], receiver, gossip, rows=sender)
    return Messages.empty()


def neighbour_grid(inbox: Messages, rows: torch.Tensor, key: str, width: int, members: torch.Tensor) -> torch.Tensor:
    """(C, M, P): slot j of row i holds what j sent i (zeros elsewhere)."""
    count = members.shape[0]
    grid = torch.zeros(len(rows), count, width)
    if not len(inbox):
        return grid
    position = torch.searchsorted(rows, inbox.dst)
    src = inbox.src.clamp(0, count - 1)
    valid = (inbox.src >= 0) & (inbox.src < count) & members[inbox.dst.clamp_min(0), src]
    grid[position[valid], src[valid]] = inbox.value(key)[valid].to(grid.dtype)
    return grid


def received_gradients(inbox: Messages, state: dict[str, Any], rows: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """(C, M, P): g_ji from each neighbour j, and the row's own g_ii in its own slot."""
    grid = neighbour_grid(inbox, rows, GRADIENT, state["cross"].shape[2], members)
    mine = torch.arange(len(rows))
    grid[mine, rows] = state["cross"][mine, rows]
    return grid


def gossip_mix(inbox: Messages, rows: torch.Tensor, members: torch.Tensor, weights: torch.Tensor,
               own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """sum_j w_ij v_j for each gossiped key, the row's own value `own[key]` in its slot
    (`weights`: W (M, M), on the rows' device)."""
    w = weights[rows]
    mine, out = torch.arange(len(rows)), {}
    for key, value in own.items():
        grid = neighbour_grid(inbox, rows, key, value.shape[1], members)
        grid[mine, rows] = value.to(grid.dtype)
        out[key] = torch.bmm(w.to(grid.dtype).unsqueeze(1), grid).squeeze(1)
    return out
