"""Each agent's neighbourhood as a few slots, not one per client (issue 35).

Cross-gradient methods (PDSL, DP-CGA) hold per agent one model, one gradient and one
weight per neighbour. Indexed by client id that is (M, M, P) and costs M^2 per round
whatever the graph; here agent i's neighbourhood M_i (itself included) fills slots
0..k_i-1 of a table of K = max_i k_i slots, in ascending client id, and the slots
beyond k_i are padding (`real` False). So state and work grow with the edges: a ring
has K = 3 at any M, the complete graph K = M (slot j is client j, the layout of a
per-client grid, so its numbers are unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NeighbourTable"]


@dataclass(frozen=True)
class NeighbourTable:
    """Slots of every agent's neighbourhood, all on the run's device.

    `ids` (M, K) int64: the client in each slot (padding: the agent itself, so gathers
    stay in range); `real` (M, K) bool: the slot holds a neighbour; `own` (M,) int64:
    the agent's own slot; `weights` (M, K) float64: w_ij of W for the slot's j, 0 on
    padding. `keys` (M, K) is `ids` with padding replaced by M: each row ascending, what
    `slot_of` searches."""

    ids: torch.Tensor
    real: torch.Tensor
    own: torch.Tensor
    weights: torch.Tensor
    keys: torch.Tensor

    @classmethod
    def of(cls, members: torch.Tensor, matrix: torch.Tensor) -> NeighbourTable:
        """The table of neighbourhoods `members` (M, M) bool (row i: M_i, i included)
        with mixing weights `matrix` (M, M)."""
        count = members.shape[0]
        row, col = members.nonzero(
            as_tuple=True
        )  # sorted by row, then by column: ascending ids per row
        degree = members.sum(1)
        width = int(degree.max()) if count else 0
        slot = torch.arange(len(row), device=row.device) - (degree.cumsum(0) - degree)[row]
        ids = torch.arange(count, device=row.device).unsqueeze(1).repeat(1, width)
        ids[row, slot] = col
        real = torch.zeros(count, width, dtype=torch.bool, device=row.device)
        real[row, slot] = True
        own = torch.zeros(count, dtype=torch.int64, device=row.device)
        mine = row == col
        own[row[mine]] = slot[mine]
        weights = torch.zeros(count, width, dtype=torch.float64, device=row.device)
        weights[row, slot] = matrix[row, col].double()
        return cls(ids, real, own, weights, torch.where(real, ids, count))

    @property
    def width(self) -> int:
        """K: the largest neighbourhood, the slots every agent holds."""
        return int(self.ids.shape[1])

    def slot_of(
        self, agent: torch.Tensor, client: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot (n,), valid (n,) bool): the slot `client[n]` fills in the table of
        `agent[n]`; `valid` False where it is not in that agent's neighbourhood (any
        id, even out of range: what peers claim to be is untrusted)."""
        count = self.ids.shape[0]
        agent = agent.clamp(0, count - 1)
        keys = self.keys[agent]
        slot = (
            torch.searchsorted(keys, client.unsqueeze(1).to(keys.dtype))
            .squeeze(1)
            .clamp_max(self.width - 1)
        )
        valid = (
            (client >= 0)
            & (client < count)
            & (keys.gather(1, slot.unsqueeze(1)).squeeze(1) == client)
        )
        return slot, valid
