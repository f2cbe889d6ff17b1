"""The ideal defense: an oracle that drops exactly the malicious clients' updates.

The reference point of the P4 paper's malicious-fraction sweep: the accuracy a perfect
detector would reach. The harness (never a real defense) reveals the malicious clients
to it before training; it then keeps every benign update and averages them with their
weights. Without an attack it keeps everything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense

if TYPE_CHECKING:
    from p4bench.config import RunConfig


class IdealDefense(Defense):
    """Drop the updates of the clients the harness marked malicious."""

    name = "ideal"
    description = (
        "oracle: drops exactly the malicious clients' updates (reference for real defenses)"
    )
    uses_identities = True
    needs_oracle = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.malicious: torch.Tensor | None = None

    def reveal_malicious(self, malicious: torch.Tensor) -> None:
        self.malicious = malicious.bool().clone()

    def select(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> torch.Tensor:
        senders = identities.get("senders")
        if self.malicious is None or senders is None:
            raise RuntimeError(
                "the ideal defense needs the harness to reveal the malicious clients and the senders"
            )
        real = senders >= 0
        bad = torch.zeros_like(mask)
        bad[real] = self.malicious[senders[real]]
        return mask & ~bad
