"""Inflating one's records: a negated update declared with many times the records held.

Methods that average by record count (FedAvg, SCAFFOLD, FedDF) weight each upload by the
``weight`` it declares. A peer that declares more records than it holds takes a larger
share of the mean: on the device runtime, 359 records held and 1,400 declared passed a
bound of the whole data set (1,435) and were pinned as the sender's weight. The attack
sends -`negate` times its honest update (0: the honest update) with ``weight`` =
`inflation_factor` times the count it would declare, at most `max_inflated_records`
(e.g. the data set's records, to stay within the old [0, N] bound). The receive gate
holds each sender to its own partition's size (`p4bench.engine.declared_sizes`) and
rejects the upload as ``declared records above partition``, naming the sender.
Messages without a ``weight`` entry are sent unchanged: nothing is declared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.engine.messages import update_keys
from p4bench.engine.receive_gate import WEIGHT_KEY
from p4bench.engine.threats import update_vectors, with_update_vectors
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng


class RecordInflation(Attack):
    """Malicious clients declare `inflation_factor` times their records with a negated update."""

    name = "record-inflation"
    description = (
        "malicious clients declare inflation_factor times their records as the aggregation "
        "weight and send their update negated"
    )
    options = Attack.options + (
        Option(
            "inflation_factor",
            float,
            4.0,
            "the declared weight is this many times the honest one",
            low=1.0,
        ),
        Option(
            "max_inflated_records",
            int,
            None,
            "the most records declared (e.g. the data set's, within a bound of [0, N]); default: no cap",
            low=1,
        ),
        Option(
            "negate",
            float,
            3.0,
            "the update sent is -negate times the honest one (0: the honest update)",
            low=0.0,
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.factor = float(self.option_values["inflation_factor"])
        cap = self.option_values["max_inflated_records"]
        self.cap = float(cap) if cap is not None else float("inf")
        self.negate = float(self.option_values["negate"])

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
        payload[WEIGHT_KEY] = (payload[WEIGHT_KEY] * self.factor).clamp_max(self.cap)
        if self.negate > 0 and update_keys(payload):
            payload = with_update_vectors(payload, -self.negate * update_vectors(payload))
        return Messages(messages.src, messages.dst, payload)
