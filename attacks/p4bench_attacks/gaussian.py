"""Gaussian attack (Blanchard et al. 2017; ByzFL's `Gaussian`): send random noise.

Each malicious client sends i.i.d. N(mu, sigma^2) values per coordinate in place of its
``update.*`` payload (an update when the method sends updates, a model when it sends
models), drawn from its own attack stream. Options `gaussian_mean` (0) and
`gaussian_std` (1).
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


class Gaussian(Attack):
    """Replace the sent update by N(gaussian_mean, gaussian_std^2) noise."""

    name = "gaussian"
    description = "malicious clients send i.i.d. Gaussian noise N(mean, std^2) as their update"
    options = Attack.options + (
        Option("gaussian_mean", float, 0.0, "mean of the noise sent per coordinate"),
        Option(
            "gaussian_std", float, 1.0, "standard deviation of the noise sent per coordinate", low=0
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.mean: float = self.option_values["gaussian_mean"]
        self.std: float = self.option_values["gaussian_std"]

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        honest = honest_vectors(messages)
        noise = rng.normal(honest.shape[1]) * self.std + self.mean
        return send(messages, noise.to(honest.dtype))
