"""Sign flipping: send the negated update.

Default (`sign_flip_source: own`, as Blades' SignFlip and the gradient-reversal attack of
the robustness literature): each malicious client sends -s * its own honest update, s =
`sign_flip_scale` (1). With `sign_flip_source: mean` (ByzFL's SignFlipping) it sends
-s * the mean of the honest updates its receiver gets (an omniscient variant; see
`p4bench_attacks._honest`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import honest_pools, honest_vectors, send

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng

SOURCES = ("own", "mean")


class SignFlip(Attack):
    """Send -s * (own update), or -s * (mean honest update) with sign_flip_source=mean."""

    name = "sign-flip"
    description = "malicious clients send their update negated (option: the negated honest mean)"
    options = Attack.options + (
        Option("sign_flip_scale", float, 1.0, "s: attackers send -s times the update"),
        Option(
            "sign_flip_source",
            str,
            "own",
            "which update is negated: the attacker's own, or the mean honest "
            "update its receiver gets (omniscient)",
            choices=SOURCES,
        ),
    )
    omniscient = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.scale: float = self.option_values["sign_flip_scale"]
        self.source: str = self.option_values["sign_flip_source"]

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        honest = honest_vectors(messages)
        if self.source == "own":
            return send(messages, -self.scale * honest)
        pools = honest_pools(messages, observed, colluding)
        return send(messages, (-self.scale * pools.mean()[pools.row]).to(honest.dtype))
