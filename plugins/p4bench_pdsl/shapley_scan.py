"""Monte-Carlo Shapley prefixes on a model linear in its parameters, scanned order by order.

`p4bench_pdsl.shapley_linear` turns each candidate of an agent into one block, its margins
on Q (a coalition is right on a sample exactly where the sum of its members' blocks has
no negative class). Monte-Carlo Shapley values every prefix of R random orders; here each
order keeps one row of sums that its next player's block is added to, level by level:

    for each agent: sums (R rows) = blocks of the orders' first players;
    for each length k: sums += blocks of the orders' k-th players; count the samples
    whose smallest class is not negative.

One `_foreach_add_` of slices of the agent's blocks (no indexed gather), one reduction over
classes and one count per length, on a few hundred kilobytes per agent that stay in cache,
and nothing planned on the host; the full neighbourhood (every order's last prefix) is
summed once. The generic path (`coalition_values` over masks) first finds the distinct
coalitions and chains them (`shapley_rows`), which saves the ~10% of prefixes that repeat
but costs the planning and an indexed gather and addition per level (`index_add_`, several
times slower than `add_`); it stays the way for small neighbourhoods (`SCAN_MIN_PLAYERS`).
A prefix's sum is its order's blocks added in the order's sequence, as the generic path
adds them along a chain: the same float sums and counts, except that the generic path sums
a coalition two orders reach (or the full neighbourhood) along one of them, so a sample
on a tie within float rounding may count differently there (one sample of |Q| in one
prefix: seen once in 100 agents of 100 players, never in the 20 x 20 bench or the tests).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p4bench.engine.training import Workspace
from p4bench_pdsl.shapley_linear import _candidate_weights, _LabelGroups, _own_margins

__all__ = ["SCAN_MIN_PLAYERS", "linear_prefix_values"]

MARGIN_AGENTS = (
    2  # agents whose blocks one round of products computes (2-4: within 2%; 10: 5% slower)
)
# The scan costs a few calls per agent and prefix length; the chained distinct coalitions
# (`shapley_rows`) a few per chunk of agents and length. Measured at one thread (R = 10):
# 160 agents of 3 players, |Q| = 200: the chains 2x faster; 5 players: the scan 1.1x, 12
# players 1.35x; 20 agents of 20 players, |Q| = 2,000: the scan 1.6x; 100 of 100: 22x.
SCAN_MIN_PLAYERS = 4


@torch.no_grad()
def linear_prefix_values(
    like: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    q_x: torch.Tensor,
    q_y: torch.Tensor,
    q_n: torch.Tensor | None,
    order: torch.Tensor,
    players: torch.Tensor,
) -> torch.Tensor:
    """(A, R, n_max + 1) float64: the accuracy of every order's prefixes of 0..n_a players
    (the empty one worth 0; longer ones, past the agent's n_a = `players[a]`, worth 0 and
    not evaluated), `order` (A, R, K) the slot at each position of each order (the
    agent's players first). Arguments as `p4bench_pdsl.shapley.coalition_values` (the model
    linear in its parameters, `linear_in_parameters`)."""
    num_agents, slots, _ = g.shape
    counts = players.tolist()  # the players and orders read to the host once per call (on a
    order_host = order.cpu()  # GPU every read is a synchronisation)
    lengths = max(counts, default=0)
    repeats = order.shape[1]
    device = g.device
    classes, width = int(like["bias"].shape[-1]), q_y.shape[-1]
    groups = None if q_n is not None else _LabelGroups(q_x, q_y, classes)
    rows_per_block = classes - 1 if groups is not None else classes
    right = torch.zeros(num_agents, lengths + 1, repeats, dtype=g.dtype, device=device)
    if lengths == 0 or num_agents == 0:
        return right.transpose(1, 2).double()
    workspace = Workspace()  # buffers reused by every chunk: a fresh one costs its page faults
    sums = workspace.get("scan.sums", (repeats, rows_per_block * width), g.dtype, device=device)
    mins = workspace.get("scan.mins", (repeats, width), g.dtype, device=device)
    for first in range(0, num_agents, MARGIN_AGENTS):
        last = min(first + MARGIN_AGENTS, num_agents)
        weights = _candidate_weights(like, x[first:last], g[first:last], lr)
        out = workspace.get(
            "scan.blocks", ((last - first) * slots * rows_per_block, width), g.dtype, device=device
        )
        if groups is not None:
            groups.margins(weights, out)
        else:  # each agent's own validation set, padded (padding is never right)
            assert q_n is not None
            real = torch.arange(width, device=q_y.device) < q_n[first:last, None]
            _own_margins(weights, q_x[first:last], q_y[first:last], real, out)
        blocks = out.view(last - first, slots, -1)
        for agent in range(first, last):
            own = blocks[agent - first]
            _scan_agent(own, order_host[agent], counts[agent], sums, mins, right[agent])
    total = (
        torch.full((num_agents,), float(width), dtype=torch.float64, device=device)
        if q_n is None
        else q_n.clamp_min(1).double()
    )
    return right.transpose(1, 2).double() / total.view(-1, 1, 1)


def _scan_agent(
    blocks: torch.Tensor,
    order: torch.Tensor,
    players: int,
    sums: torch.Tensor,
    mins: torch.Tensor,
    right: torch.Tensor,
) -> None:
    """One agent's prefixes: `right[k, r]` the samples on which order r's sum of its first
    k players' `blocks` (K, classes * width) has no negative class, for 1 <= k <= `players`
    (rows past them left as they are); `order` (R, K) on the host. Each row of `sums` adds
    its next block in place (a slice of `blocks`, no gather: an indexed gather and addition
    cost twice a plain one), and each length is counted at once (`mins`: its smallest
    classes, a buffer that stays in cache). The last prefix holds every player in every
    order: valued once (order 0's sum)."""
    repeats, width = sums.shape[0], mins.shape[1]
    slots = order[:, :players].T.tolist()  # (players, R): the slot at each position
    candidates, rows_of_sums = blocks.unbind(0), sums.unbind(0)
    classes = sums.view(repeats, -1, width)
    for length in range(players):
        if length == players - 1:  # every order holds all players: order 0's sum, copied
            _extend(rows_of_sums[:1], [candidates[slots[length][0]]], length == 0)
            torch.amin(classes[:1], dim=1, out=mins[:1])
            right[length + 1].copy_(mins[0].ge_(0).sum().expand(repeats))  # no host read
        else:
            _extend(rows_of_sums, [candidates[slot] for slot in slots[length]], length == 0)
            torch.amin(classes, dim=1, out=mins)
            # floats: exact counts below 2^24 samples
            torch.sum(mins.ge_(0), dim=1, out=right[length + 1])


def _extend(rows: tuple[torch.Tensor, ...], added: list[torch.Tensor], first: bool) -> None:
    """Each row of sums takes (the first player) or adds its next player's block in place."""
    if first:
        torch._foreach_copy_(rows, added)
    else:
        torch._foreach_add_(rows, added)
