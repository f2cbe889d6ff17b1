"""A compromised group aggregator: when its turn comes, it distributes a poisoned model.

P4's co-training (Algorithm 2) rotates the aggregator role among a group's members; the
aggregator averages the members' proxy deltas and sends the new group proxy to every
member (`distribute`, payload ``model.*``), which the paper's members adopt wholesale.
A malicious member sends instead `aggregator_poison_scale` times the honest aggregate
(default -1: the negated model, issue #47's 0.771 -> 0.000). Its uploads stay honest:
this attack rules a group through the aggregator's role alone. With
`aggregator_poison_start` it also poisons the model a first-round aggregator announces
as every member's starting proxy.

It acts on any `distribute` exchange whose messages carry ``model.*`` (and, with the start
option, an `announce` that does), so it runs wherever the method runs: batched in the
simulator, and inside a compromised peer on the device runtime, whose driver applies it to
the messages that peer sends. P4's `aggregator_check=recompute` (default) rejects the
poisoned model and names the aggregator; `aggregator_check=none` is the paper's protocol,
which it rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Capabilities, Messages
from p4bench.engine.messages import MODEL_PREFIX
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng

DISTRIBUTE, ANNOUNCE = "distribute", "announce"


class AggregatorPoison(Attack):
    """As its group's aggregator, a malicious member sends s times the aggregate (s = -1)."""

    name = "aggregator-poison"
    description = (
        "a malicious member, when it is its group's aggregator (P4), distributes a poisoned "
        "model: the aggregate times aggregator_poison_scale (default -1, negated)"
    )
    options = Attack.options + (
        Option(
            "aggregator_poison_scale",
            float,
            -1.0,
            "s: the aggregator distributes s times the honest aggregate (-1: negated)",
        ),
        Option(
            "aggregator_poison_start",
            bool,
            False,
            "also poison the starting proxy a first-round aggregator announces",
        ),
    )
    tampers_models = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.scale: float = self.option_values["aggregator_poison_scale"]
        self.poison_start: bool = self.option_values["aggregator_poison_start"]

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        if not capabilities.peer_aggregator:
            return "it poisons the model a group's rotating aggregator distributes, and this method has none"
        return None

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        if exchange != DISTRIBUTE and not (exchange == ANNOUNCE and self.poison_start):
            return messages  # uploads and plain announcements go out honest
        payload = messages.payload
        poisoned = {
            key: (self.scale * value).to(value.dtype) if key.startswith(MODEL_PREFIX) else value
            for key, value in payload.items()
        }
        return Messages(messages.src, messages.dst, poisoned)
