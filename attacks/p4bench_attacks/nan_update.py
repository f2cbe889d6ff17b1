"""Non-finite updates: send NaN (or +/-inf) in place of the model update.

A malformed payload with the right layout, as a peer with a stolen key (or a diverged
client) can send: without the receive gate, one NaN entry poisons a plain mean, and a
distance-based defense that ranks non-finite distances first (as Krum did) keeps it.
Option `nan_value`: nan (default), inf or -inf; `nan_fraction`: the share of entries
replaced (1.0: all; a smaller share hides the payload among finite values).
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

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


class NanUpdate(Attack):
    """Malicious clients send updates whose entries are NaN (or +/-inf)."""

    name = "nan-update"
    description = (
        "malicious clients send non-finite updates (NaN, inf or -inf) with the honest layout"
    )
    options = Attack.options + (
        Option("nan_value", str, "nan", "the value sent", choices=tuple(VALUES)),
        Option(
            "nan_fraction",
            float,
            1.0,
            "share of the update's entries replaced (the first ones)",
            low=0.0,
            high=1.0,
            low_open=True,
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.value = VALUES[self.option_values["nan_value"]]
        self.fraction = float(self.option_values["nan_fraction"])

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        vectors = honest_vectors(messages).clone()
        count = max(1, int(round(self.fraction * vectors.shape[1])))
        vectors[:, :count] = self.value
        return send(messages, vectors)
