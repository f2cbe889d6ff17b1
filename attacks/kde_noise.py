"""KDE noise (the P4L paper's "noisy peers"): a malicious client replaces the weights of
its targeted layers by samples from a 1-D Gaussian kernel density estimate fitted to
those very weights, in every message it sends.

Sampling m values from the KDE of a layer's m weights w_1..w_m is: pick w_i uniformly
at random (with replacement) and add N(0, h^2). The bandwidth h is scipy's
`gaussian_kde` default (the paper gives none): Scott's rule, h = m^(-1/5) * std(w) with
ddof=1. The sent layer thus keeps roughly the honest layer's distribution (mean, spread)
while its values land at random positions. A layer whose weights are all equal (h = 0)
is resampled from itself; scipy would refuse its singular covariance.

Layers: each ``update.<param name>`` payload entry is one parameter tensor and counts as
one layer, fitted on its own (weight and bias of a dense layer are two). Option `kde_layers`
= N targets the last N ``update.*`` keys in sorted key order (all of them if fewer),
which is the order the engine flattens parameters in. Sorted names follow depth only
partly for the suite's models:

- linear: bias, weight; the default N = 2 is the whole model (the paper's Avito
  setting, its single dense layer);
- cnn and the small-input scatter-cnn: ..., conv2.weight, fc.bias, fc.weight, fc1.bias,
  fc1.weight: "fc" (the output layer) sorts before "fc1" (the hidden dense layer), so
  N = 2 targets fc1 only, and N = 4 both dense layers (the paper's CIFAR setting);
- scatter-cnn on 8x8 or larger maps: ..., fc.bias, fc.weight; N = 2 is its only dense
  layer.

Methods that send one flattened ``update.params`` entry have a single "layer", the
whole parameter vector. When the payload is a delta from `reference`, the honest model
reference + delta is resampled and the new delta sent. Draws come from each message's
row of the attack streams, so a client's noise is the same in every runtime.
"""

from __future__ import annotations

from typing import Any

import torch

from p4bench.engine import Attack, Messages
from p4bench.engine.messages import update_keys
from p4bench.options import Option
from p4bench.rng import ClientRng


def scott_bandwidth(weights: torch.Tensor) -> torch.Tensor:
    """(n,) bandwidth of each row of `weights` (n, m): scipy's default, m^(-1/5) * std (ddof=1)."""
    m = weights.shape[1]
    if m < 2:  # no spread to estimate: the one weight is kept
        return weights.new_zeros(weights.shape[0])
    return weights.std(dim=1, correction=1) * m ** -0.2


def kde_resample(weights: torch.Tensor, rng: ClientRng) -> torch.Tensor:
    """(n, m): m samples per row from the Gaussian KDE of that row's m weights, drawn from
    `rng` (one row per message)."""
    m = weights.shape[1]
    if m == 0:
        return weights
    pick = (rng.uniform(m) * m).long().clamp_(max=m - 1).to(weights.device)
    noise = rng.normal(m).to(weights.device, weights.dtype)
    return weights.gather(1, pick) + scott_bandwidth(weights).unsqueeze(1) * noise


class KDENoise(Attack):
    """Replace the last `layers` update tensors by samples of their own Gaussian KDE."""

    name = "kde-noise"
    description = "noisy peers: the last layers' weights are resampled from a Gaussian KDE fitted to them"
    options = Attack.options + (
        Option("kde_layers", int, 2, "how many update tensors are resampled: the last N in sorted parameter-name "
               "order (each tensor, e.g. a weight or a bias, is fitted on its own)", low=1),
    )

    def __init__(self, config: Any, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.layers: int = self.option_values["kde_layers"]

    def targets(self, payload: dict[str, torch.Tensor]) -> list[str]:
        """The ``update.*`` keys this attack resamples."""
        return update_keys(payload)[-self.layers:]

    def tamper(self, exchange: str, messages: Messages, rng: ClientRng, reference: torch.Tensor | None = None) -> Messages:
        payload = messages.payload
        targets = set(self.targets(payload))
        out, offset = dict(payload), 0
        for key in update_keys(payload):  # sorted: the layout of `reference`, and a fixed draw order
            value = payload[key]
            size = int(value.shape[1:].numel())
            if key in targets:
                honest = value.flatten(start_dim=1).double()
                base = None if reference is None else reference[:, offset : offset + size].double()
                if base is not None:
                    honest = honest + base  # the honest model, whose weights the KDE is fitted to
                sampled = kde_resample(honest, rng)
                if base is not None:
                    sampled = sampled - base
                out[key] = sampled.reshape(value.shape).to(value.dtype)
            offset += size
        return Messages(messages.src, messages.dst, out)
