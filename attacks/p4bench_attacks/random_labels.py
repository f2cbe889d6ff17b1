"""Random labels (Karras et al. §III-G.1, "noisy clients"): every training label of a
malicious client is replaced by a class drawn uniformly at random, so its labels carry
no information about its images.

A data attack like label-flip: it poisons labels once, before any training, and so
acts on every method (option `attack_timing` does not apply). The draws come from each
malicious client's attack stream, keyed by the run seed and the client id, so a client
gets the same labels in the simulator, the per-client runtimes and on devices.
"""

from __future__ import annotations

import torch

from p4bench.engine import Attack
from p4bench.rng import ClientRng


class RandomLabels(Attack):
    """Every label of a malicious client becomes a uniformly random class."""

    name = "random-labels"
    description = (
        "data poisoning: malicious clients train on uniformly random labels (noisy clients)"
    )
    random_poisoning = True

    def poison_labels(self, labels: torch.Tensor, rng: ClientRng | None = None) -> torch.Tensor:
        """Labels (C, n) -> uniform random classes from `rng` (one row per client); padding
        entries (outside [0, L)) are kept."""
        if rng is None:
            raise ValueError(
                "random-labels draws from the clients' attack streams: pass rng (one row per client)"
            )
        # floor(u * L) of a 53-bit uniform: uniform over the classes up to 2**-53, and entry
        # k depends only on the client's stream and k, not on how wide the padded row is
        drawn = (
            (rng.uniform(labels.shape[1]) * self.num_classes)
            .long()
            .clamp_(max=self.num_classes - 1)
        )
        valid = (labels >= 0) & (labels < self.num_classes)
        return torch.where(valid, drawn.to(labels.dtype), labels)
