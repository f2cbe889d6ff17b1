"""Repeated messages: send many copies of one (negated) update to each receiver.

Nothing in a message says how many a sender may send: a peer with a stolen key can send
its destination the same update again and again, so that a vote among updates (m-Krum's
nearest neighbours, a median) counts it many times. Each malicious message becomes
`duplicate_copies` (default 10) copies of -s times the update (s = `duplicate_scale`,
default 1; 0 sends the honest update repeated). The receive gate keeps the first
`Method.messages_per_pair` of them and rejects the rest, naming the sender.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import honest_vectors, send

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng


class DuplicateMessages(Attack):
    """Each malicious message sent `duplicate_copies` times, its update negated."""

    name = "duplicate-messages"
    description = "malicious clients send each receiver many copies of their negated update"
    options = Attack.options + (
        Option("duplicate_copies", int, 10, "copies of each message sent", low=1),
        Option(
            "duplicate_scale",
            float,
            1.0,
            "s: the copies carry -s times the update (0: the honest update)",
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.copies = int(self.option_values["duplicate_copies"])
        self.scale = float(self.option_values["duplicate_scale"])

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        flipped = (
            honest_vectors(messages) if self.scale == 0 else -self.scale * honest_vectors(messages)
        )
        tampered = send(messages, flipped.to(honest_vectors(messages).dtype))
        repeat = torch.arange(len(messages)).repeat_interleave(self.copies)
        return tampered.select(repeat)
