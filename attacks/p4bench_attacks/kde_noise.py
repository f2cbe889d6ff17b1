"""KDE noise (the P4L paper's "noisy peers"): a malicious client replaces the weights of
its targeted layers by samples from a 1-D Gaussian kernel density estimate fitted to
those very weights, in every message it sends.

Sampling m values from the KDE of a layer's m weights w_1..w_m is: pick w_i uniformly
at random (with replacement) and add N(0, h^2). The bandwidth h is scipy's
`gaussian_kde` default (the paper gives none): Scott's rule, h = m^(-1/5) * std(w) with
ddof=1. The sent layer thus keeps roughly the honest layer's distribution (mean, spread)
while its values land at random positions. A layer whose weights are all equal (h = 0)
is resampled from itself; scipy would refuse its singular covariance.

Layers (`kde_unit=layer`, the default): a layer is the update tensors sharing a name
before its last dot (a dense layer's weight and bias), each tensor still fitted on its
own. Option `kde_layers` = N targets the last N layers by depth (all of them if fewer),
the paper's "last two dense layers" on CIFAR with the default N = 2. Depth comes from the
shapes, not the names (in sorted names "fc", the output layer, comes before "fc1"): the
dense layers (2-D weights, out x in) are chained back from the one with as many outputs as
there are classes, each preceded by the one whose outputs are its inputs; other layers
(convolutions) come before them. So:

- linear: its one dense layer (the paper's Avito setting);
- cnn and the small-input scatter-cnn: fc1 and fc, both dense layers (the paper's CIFAR
  setting);
- scatter-cnn on 8x8 or larger maps: its only dense layer, fc.

`kde_unit=tensor` counts update tensors in sorted name order instead (before 0.2: the
default, which on cnn hit fc1 alone).

Methods that send one flattened ``update.params`` entry have a single "layer", the
whole parameter vector. When the payload is a delta from `reference`, the honest model
reference + delta is resampled and the new delta sent. Draws come from each message's
row of the attack streams, so a client's noise is the same in every runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.engine.messages import update_keys
from p4bench.options import Option
from p4bench.rng import ClientRng

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def scott_bandwidth(weights: torch.Tensor) -> torch.Tensor:
    """(n,) bandwidth of each row of `weights` (n, m): scipy's default, m^(-1/5) * std (ddof=1)."""
    m = weights.shape[1]
    if m < 2:  # no spread to estimate: the one weight is kept
        return weights.new_zeros(weights.shape[0])
    factor: float = m**-0.2  # typeshed types a power with a negative exponent as Any
    return weights.std(dim=1, correction=1) * factor


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
    description = (
        "noisy peers: the last layers' weights are resampled from a Gaussian KDE fitted to them"
    )
    options = Attack.options + (
        Option(
            "kde_layers",
            int,
            2,
            "how many layers are resampled: the last N by depth (each tensor of a layer, "
            "e.g. a weight or a bias, is fitted on its own)",
            low=1,
        ),
        Option(
            "kde_unit",
            str,
            "layer",
            "what kde_layers counts: layer (a weight and its bias; depth from the shapes, "
            "the paper's 'last two dense layers') or tensor (update tensors in sorted name order)",
            choices=("layer", "tensor"),
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.layers: int = self.option_values["kde_layers"]
        self.by_layer = self.option_values["kde_unit"] == "layer"
        self.num_classes = num_classes

    def targets(self, payload: dict[str, torch.Tensor]) -> list[str]:
        """The ``update.*`` keys this attack resamples."""
        keys = update_keys(payload)
        if not self.by_layer:
            return keys[-self.layers :]
        chosen = layers_by_depth(payload, keys, self.num_classes)[-self.layers :]
        return [key for layer in chosen for key in layer]

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        payload = messages.payload
        targets = set(self.targets(payload))
        out, offset = dict(payload), 0
        for key in update_keys(
            payload
        ):  # sorted: the layout of `reference`, and a fixed draw order
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


def layers_by_depth(
    payload: dict[str, torch.Tensor], keys: list[str], num_classes: int
) -> list[list[str]]:
    """The update keys grouped by layer (the key before its last dot), shallowest first:
    layers without a 2-D weight (convolutions) in name order, then the dense layers chained
    back from the output (outputs = classes), each after the one whose outputs are its
    inputs; dense layers off that chain go before it, in name order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rpartition(".")[0], []).append(key)
    dense: dict[str, tuple[int, int]] = {}  # layer -> (outputs, inputs) of its 2-D weight
    for layer, members in groups.items():
        weight = f"{layer}.weight"
        if weight in members and payload[weight].dim() == 3:  # (messages, out, in)
            dense[layer] = (int(payload[weight].shape[1]), int(payload[weight].shape[2]))
    chain: list[str] = []
    wanted = num_classes
    while True:
        step = [
            layer
            for layer, (out, _) in sorted(dense.items())
            if out == wanted and layer not in chain
        ]
        if len(step) != 1:  # none, or ambiguous: the chain stops
            break
        chain.insert(0, step[0])
        wanted = dense[step[0]][1]
    others = [layer for layer in sorted(groups) if layer not in dense]
    unchained = [layer for layer in sorted(dense) if layer not in chain]
    return [groups[layer] for layer in others + unchained + chain]
