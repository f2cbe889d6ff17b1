"""Helpers shared by the defenses: masked coordinate-wise order statistics and memory
kept per (receiver, sender) pair, so stateful defenses behave the same whether one
process aggregates for every receiver (simulator) or each node runs its own."""

from __future__ import annotations

import torch

from p4bench.engine.screen import finite_rows


def sorted_coordinates(
    updates: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (B, n, P) sorted along n with padded entries last, count (B,) real ones).

    Updates with a non-finite entry count as padding, also when the helper is called
    without the defenses' screen: an inf would sort into the order statistics as a value."""
    mask = finite_rows(updates, mask)
    padded = updates.double().masked_fill(~mask.unsqueeze(-1), float("inf"))
    return torch.sort(padded, dim=1).values, mask.sum(dim=1)


def gather_rank(values: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """(B, P) entry of rank `rank` (B,) of each sorted row."""
    index = rank.clamp_min(0).view(-1, 1, 1).expand(-1, 1, values.shape[2])
    return values.gather(1, index).squeeze(1)


class PairMemory:
    """Vectors remembered per (receiver, sender) pair, e.g. FoolsGold histories.

    The ids are read back to the host once per call (dictionary keys); the vectors stay
    where they are, on the run's device."""

    def __init__(self) -> None:
        self.store: dict[tuple[int, int], torch.Tensor] = {}

    def gather(
        self, receivers: torch.Tensor, senders: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (B, n, P) zeros where unknown, known (B, n) bool)."""
        values = torch.zeros_like(like)
        known = torch.zeros(senders.shape, dtype=torch.bool, device=senders.device)
        if not self.store:
            return values, known
        rows, slots, found = [], [], []
        for b, (receiver, *row) in enumerate(
            torch.cat((receivers.unsqueeze(1), senders), dim=1).tolist()
        ):
            for i, sender in enumerate(row):
                stored = self.store.get((receiver, sender)) if sender >= 0 else None
                if stored is not None:
                    rows.append(b)
                    slots.append(i)
                    found.append(stored)
        if found:
            index = (
                torch.tensor(rows, device=values.device),
                torch.tensor(slots, device=values.device),
            )
            values[index] = torch.stack(found).to(values.dtype)
            known[index] = True
        return values, known

    def put(
        self,
        receivers: torch.Tensor,
        senders: torch.Tensor,
        values: torch.Tensor,
        which: torch.Tensor,
    ) -> None:
        """Remember `values[b, i]` for every pair where `which[b, i]`."""
        b, i = which.nonzero().unbind(1)
        pairs = torch.stack((receivers[b], senders[b, i]), dim=1).tolist()
        for (receiver, sender), value in zip(pairs, values.detach()[b, i].unbind(0)):
            self.store[(receiver, sender)] = (
                value.clone()
            )  # its own copy: frees the rest when replaced


class ReceiverMemory:
    """One vector remembered per receiver, e.g. its previous aggregate."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}

    def gather(
        self, receivers: torch.Tensor, width: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (B, P) zeros where unknown, known (B,) bool)."""
        values = torch.zeros(len(receivers), width, dtype=dtype, device=receivers.device)
        known = torch.zeros(len(receivers), dtype=torch.bool, device=receivers.device)
        ids = receivers.tolist() if self.store else []
        rows = [b for b, receiver in enumerate(ids) if receiver in self.store]
        if rows:
            index = torch.tensor(rows, device=receivers.device)
            values[index] = torch.stack([self.store[ids[b]] for b in rows]).to(dtype)
            known[index] = True
        return values, known

    def put(self, receivers: torch.Tensor, values: torch.Tensor) -> None:
        for receiver, value in zip(receivers.tolist(), values.detach().unbind(0)):
            self.store[receiver] = value.clone()


def receivers_or_default(
    identities: dict[str, torch.Tensor], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(receivers (B,), senders (B, n)) from the aggregator, or positional ids when a
    defense is called directly (tests, third-party callers) without identities."""
    receivers = identities.get("receivers")
    senders = identities.get("senders")
    if receivers is None:
        receivers = torch.arange(mask.shape[0])
    if senders is None:
        senders = torch.where(
            mask,
            torch.arange(mask.shape[1]).expand_as(mask),
            torch.full_like(mask, -1, dtype=torch.int64),
        )
    return receivers, senders
