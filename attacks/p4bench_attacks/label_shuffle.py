"""Label shuffling (the P4L paper's "label shuffle"): each malicious client relabels its
data through its own random permutation of the L classes, every label c becoming
perm[c].

The permutation is uniformly random over all L! permutations, so some classes may keep
their label (one fixed point on average); that is allowed. It is drawn from the
client's attack stream (keyed by the run seed and the client id), so a client gets the
same permutation in every runtime. A data attack like label-flip: labels are poisoned
once, before any training, on every method (option `attack_timing` does not apply).
Entries outside [0, L) are padding and are kept.
"""

from __future__ import annotations

import torch

from p4bench.engine import Attack
from p4bench.rng import ClientRng


class LabelShuffle(Attack):
    """Every malicious client maps its labels through its own random class permutation."""

    name = "label-shuffle"
    description = "data poisoning: each malicious client maps its labels through its own random class permutation"
    random_poisoning = True

    def permutations(self, rng: ClientRng) -> torch.Tensor:
        """(C, L): a uniformly random permutation of the classes per row of `rng`."""
        # argsort of i.i.d. 53-bit uniforms: ties (which would bias it) have probability ~L^2 / 2^53
        return torch.argsort(rng.uniform(self.num_classes), dim=1)

    def poison_labels(self, labels: torch.Tensor, rng: ClientRng | None = None) -> torch.Tensor:
        """Labels (C, n) -> perm_i[label] in row i (`rng`: one row per client); padding kept."""
        if rng is None:
            raise ValueError(
                f"{self.name} draws from the clients' attack streams: pass rng (one row per client)"
            )
        perm = self.permutations(rng).to(labels.dtype)
        valid = (labels >= 0) & (labels < self.num_classes)
        mapped = perm.gather(1, labels.clamp(0, self.num_classes - 1).long())
        return torch.where(valid, mapped, labels)
