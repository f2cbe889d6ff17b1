"""A Little Is Enough (Baruch, Baruch and Goldberg, NeurIPS 2019).

The colluding attackers all send mu + z * sigma, the coordinate-wise mean and (unbiased)
standard deviation of the honest updates their receiver gets, shifted by z standard
deviations: small enough per coordinate to look benign to median- and distance-based
rules. z is the paper's z_max for n updates at the receiver of which m are malicious:
s = floor(n / 2 + 1) - m supporters are needed and z_max = Phi^-1((n - s) / n) (s is
kept >= 1 so z stays finite when attackers are a majority). Option `alie_z` fixes z.
Omniscient: see `p4bench_attacks._honest` for what the attackers know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import honest_pools, send, update_dtype

if TYPE_CHECKING:
    from p4bench.rng import ClientRng


def alie_z(total: torch.Tensor, malicious: torch.Tensor) -> torch.Tensor:
    """z_max of Baruch et al. for `total` updates of which `malicious` are attackers'."""
    n = total.double()
    supporters = (torch.floor(n / 2 + 1) - malicious.double()).clamp_min(1)
    quantile = ((n - supporters) / n).clamp(1e-6, 1 - 1e-6)
    z: torch.Tensor = torch.special.ndtri(quantile)  # torch.special is untyped: Any
    return z


class ALittleIsEnough(Attack):
    """Send mean + z * std of the honest updates (z from n and m, or option alie_z)."""

    name = "alie"
    description = "A Little Is Enough: malicious clients send mean + z*std of the honest updates"
    options = Attack.options + (
        Option(
            "alie_z",
            float,
            None,
            "z, the standard deviations added to the honest mean; default: the "
            "paper's z_max from the updates n and attackers m at each receiver",
        ),
    )
    omniscient = True

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
        fixed = self.option_values["alie_z"]
        z = (
            torch.full((len(pools.total),), float(fixed), dtype=torch.float64)
            if fixed is not None
            else alie_z(pools.total, pools.malicious)
        )
        crafted = pools.mean() + z.unsqueeze(1) * pools.std()
        dtype = update_dtype(messages)
        return send(messages, crafted[pools.row].to(dtype))
