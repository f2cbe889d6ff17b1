"""Inner-product manipulation (Xie, Koyejo and Gupta, UAI 2019, "Fall of Empires").

Every malicious client sends -epsilon * (mean of the honest updates its receiver gets),
so that the inner product of the aggregate with the true mean turns negative for
mean-like rules while the update stays small enough to pass distance-based filters.
Option `ipm_epsilon` (default 0.1, the value Karimireddy et al. 2022 use to reproduce
the attack; large values such as 100 target the median). Omniscient: see
`p4bench_attacks._honest` for what the attackers know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import honest_pools, send, update_dtype

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng


class InnerProductManipulation(Attack):
    """Send -epsilon * mean(honest updates)."""

    name = "ipm"
    description = (
        "inner-product manipulation: malicious clients send -epsilon * the mean honest update"
    )
    options = Attack.options + (
        Option(
            "ipm_epsilon",
            float,
            0.1,
            "epsilon: attackers send -epsilon * the mean honest update "
            "(large values such as 100 target the median)",
            low=0,
            low_open=True,
        ),
    )
    omniscient = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.epsilon: float = self.option_values["ipm_epsilon"]

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        pools = honest_pools(messages, observed, colluding)
        dtype = update_dtype(messages)
        return send(messages, (-self.epsilon * pools.mean()[pools.row]).to(dtype))
