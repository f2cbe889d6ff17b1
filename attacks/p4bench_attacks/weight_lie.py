"""Lying about the aggregation weight: an honest update with a false ``weight``.

Methods that average by record count (FedAvg, SCAFFOLD, FedDF) have each upload
declare its weight. A sender that states NaN poisons a weighted mean while its update
passes every distance filter; one that states a huge count takes over the mean. The
attack sends its honest update with ``weight`` = `lied_weight` (default nan). The
receive gate rejects a non-finite weight or one above the data set's records; FedAvg
weights by the count a client declared in its first upload (or uniformly), so a changed
weight is rejected too. Messages without a ``weight`` entry (P4's, whose aggregators
weight members equally) are sent unchanged: there is nothing to lie about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.engine.receive_gate import WEIGHT_KEY
from p4bench.errors import ConfigError
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng


class WeightLie(Attack):
    """Malicious clients declare weight `lied_weight` with their honest update."""

    name = "weight-lie"
    description = (
        "malicious clients send their honest update with a false aggregation weight (default NaN)"
    )
    options = Attack.options + (
        Option(
            "lied_weight", str, "nan", "the weight declared: nan, inf, -inf or a number such as 1e6"
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        try:
            self.lie = float(
                self.option_values["lied_weight"]
            )  # a string: NaN is not a valid option number
        except ValueError:
            raise ConfigError(
                "options.lied_weight",
                f"must be nan, inf, -inf or a number, got {self.option_values['lied_weight']!r}",
            ) from None

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        if WEIGHT_KEY not in messages.payload:
            return messages
        payload = dict(messages.payload)
        payload[WEIGHT_KEY] = torch.full_like(payload[WEIGHT_KEY], self.lie)
        return Messages(messages.src, messages.dst, payload)
