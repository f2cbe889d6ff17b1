"""What colluding attackers know about the honest updates a receiver gets.

Omniscient attacks from the robustness literature (ALIE, IPM, min-max) craft their
update from statistics of the honest updates. Here the statistics are taken per
receiver: the pool of a destination is every honest update sent to it in the same
exchange, i.e. the benign updates the runtime observed plus the honest updates the
malicious clients computed before tampering (their own and their colluders'). Without
observed messages (one node per process) the pool holds only the attackers' own honest
updates, a sensible fallback: ALIE and min-max then send (nearly) their own update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p4bench.engine.messages import Messages, update_keys
from p4bench.engine.threats import pad_by_destination, update_vectors, with_update_vectors


@dataclass
class HonestPools:
    """Honest updates per destination of the malicious messages.

    `updates` (D, K, P) padded, `mask` (D, K), `row` (n,) the pool row of each malicious
    message, `total` (D,) updates the destination receives, `malicious` (D,) of them
    from attackers.
    """

    updates: torch.Tensor
    mask: torch.Tensor
    row: torch.Tensor
    total: torch.Tensor
    malicious: torch.Tensor

    def mean(self) -> torch.Tensor:
        """(D, P) mean of each pool (float64)."""
        w = self.mask.double().unsqueeze(-1)
        return (self.updates.double() * w).sum(1) / w.sum(1).clamp_min(1)

    def std(self) -> torch.Tensor:
        """(D, P) unbiased coordinate-wise std of each pool (0 for a pool of one)."""
        w = self.mask.double().unsqueeze(-1)
        count = w.sum(1)
        centred = (self.updates.double() - self.mean().unsqueeze(1)) * w
        return (centred.pow(2).sum(1) / (count - 1).clamp_min(1)).sqrt()


def honest_pools(
    messages: Messages, observed: Messages | None, colluding: Messages | None = None
) -> HonestPools:
    """Pools for the malicious `messages` (their honest content), given the `observed`
    benign messages and the `colluding` attackers' honest messages held elsewhere."""
    targets = torch.unique(messages.dst)
    keys = update_keys(messages.payload)

    def relevant(others: Messages | None) -> Messages:
        if others is None or not len(others):
            return Messages.empty()
        chosen = others.select(torch.isin(others.dst, targets))
        return Messages(chosen.src, chosen.dst, {k: chosen.payload[k] for k in keys})

    own = Messages(messages.src, messages.dst, {k: messages.payload[k] for k in keys})
    allies = relevant(colluding)
    inbox = Messages.concat([own, allies, relevant(observed)]).sorted()
    dst, updates, _, mask, _ = pad_by_destination(
        inbox, torch.ones(len(inbox), dtype=torch.float64)
    )
    row = torch.searchsorted(dst, messages.dst)
    malicious = torch.bincount(
        torch.searchsorted(dst, torch.cat([messages.dst, allies.dst])), minlength=len(dst)
    )
    return HonestPools(updates, mask, row, mask.sum(1), malicious)


def send(messages: Messages, vectors: torch.Tensor) -> Messages:
    """`messages` with their ``update.*`` payload replaced by `vectors` (n, P)."""
    return Messages(messages.src, messages.dst, with_update_vectors(messages.payload, vectors))


def honest_vectors(messages: Messages) -> torch.Tensor:
    """(n, P) the ``update.*`` vectors the malicious clients computed honestly."""
    return update_vectors(messages.payload)


def update_dtype(messages: Messages) -> torch.dtype:
    """The dtype of the ``update.*`` payload."""
    return messages.payload[update_keys(messages.payload)[0]].dtype
