"""Byzantine (model-poisoning) attacks of the P4 paper's threat model.

A malicious client replaces the model it sends: by zeros, by Uniform[-1, 1) values
per coordinate, or by its honest model reflected through the global one,
w_g + (w_g - w_l). Identities are fixed from the seed for the whole run.
"""

from __future__ import annotations

import torch

from p4bench.engine.threats import ModelReplacementAttack
from p4bench.rng import ClientRng


class ByzantineZero(ModelReplacementAttack):
    """Send an all-zero model."""

    name = "byzantine-zero"
    description = "malicious clients send an all-zero model"

    def replace(
        self, honest_model: torch.Tensor, global_model: torch.Tensor, rng: ClientRng
    ) -> torch.Tensor:
        return torch.zeros_like(honest_model)


class ByzantineRandom(ModelReplacementAttack):
    """Send a model of i.i.d. Uniform[-1, 1) coordinates (each client its own stream)."""

    name = "byzantine-random"
    description = "malicious clients send a model of i.i.d. Uniform[-1, 1) values"

    def replace(
        self, honest_model: torch.Tensor, global_model: torch.Tensor, rng: ClientRng
    ) -> torch.Tensor:
        return (rng.uniform(honest_model.shape[1]) * 2 - 1).to(honest_model.dtype)


class ByzantineFlip(ModelReplacementAttack):
    """Send w_g + (w_g - w_l): the honest model reflected through the global model."""

    name = "byzantine-flip"
    description = (
        "malicious clients send w_g + (w_g - w_l), their model reflected through the global one"
    )

    def replace(
        self, honest_model: torch.Tensor, global_model: torch.Tensor, rng: ClientRng
    ) -> torch.Tensor:
        return 2 * global_model - honest_model
