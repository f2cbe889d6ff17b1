"""Pair label flipping (the P4L paper's label-flip attacks): malicious clients train with
the labels of two classes swapped.

- ``label-flip-pair``: one fixed pair for every malicious client, option `flip_pair`
  (default [0, 5], CIFAR-10's airplane <-> dog as in the paper; binary tasks, as the
  paper's Avito and IMDB, need ``-o 'flip_pair=[0, 1]'``).
- ``label-flip-random-pair``: each malicious client swaps its own random pair, drawn
  from its attack stream (keyed by the run seed and the client id), so a client gets
  the same pair in every runtime.

Like label-flip, these poison labels once, before any training, and so act on every
method (option `attack_timing` does not apply). Only the two classes of a pair change;
entries outside [0, L) are padding and are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine import Attack
from p4bench.errors import ConfigError, IncompatibleError
from p4bench.options import Option
from p4bench.rng import ClientRng
from p4bench_attacks.label_flip import class_index

if TYPE_CHECKING:
    from p4bench.config import RunConfig

_FIELD = "options.flip_pair"


def class_pair(spec: Any, num_classes: int) -> tuple[int, int]:
    """The `flip_pair` option as two distinct class indices in [0, L); ConfigError otherwise."""
    if isinstance(spec, str) or not isinstance(spec, Sequence) or len(spec) != 2:
        raise ConfigError(_FIELD, f"must be a list of two class indices, e.g. [0, 5], got {spec!r}")
    pair = [class_index(value, num_classes, _FIELD) for value in spec]
    if pair[0] == pair[1]:
        raise ConfigError(_FIELD, f"must name two different classes, got {spec!r}")
    return pair[0], pair[1]


def swap_classes(labels: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Labels (C, n) with classes first[i] <-> second[i] swapped in row i (first, second: (C,)).
    Padding (outside [0, L)) never equals a class, so it is kept."""
    a, b = first.to(labels.dtype).unsqueeze(1), second.to(labels.dtype).unsqueeze(1)
    return torch.where(labels == a, b, torch.where(labels == b, a, labels))


class LabelFlipPair(Attack):
    """Swap the two classes of option `flip_pair` in every malicious client's labels."""

    name = "label-flip-pair"
    description = (
        "data poisoning: malicious clients swap the labels of one class pair "
        "(option flip_pair, default 0 <-> 5)"
    )
    options = Attack.options + (
        Option(
            "flip_pair",
            object,
            [0, 5],
            "the two classes swapped, a list of two distinct indices in [0, L); "
            "default the paper's CIFAR-10 airplane <-> dog; binary tasks: [0, 1]",
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.pair = class_pair(self.option_values["flip_pair"], num_classes)

    def poison_labels(self, labels: torch.Tensor) -> torch.Tensor:
        rows = labels.shape[0]
        return swap_classes(
            labels, torch.full((rows,), self.pair[0]), torch.full((rows,), self.pair[1])
        )


class LabelFlipRandomPair(Attack):
    """Each malicious client swaps a class pair drawn uniformly from its attack stream.

    The pair is drawn once per client, because labels are poisoned once, before
    training; the P4L paper leaves open whether its random pair is redrawn each round.
    """

    name = "label-flip-random-pair"
    description = (
        "data poisoning: each malicious client swaps the labels of its own random class pair"
    )
    random_poisoning = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        if num_classes < 2:
            raise IncompatibleError(
                f"attack '{self.name}' needs at least two classes, the data has {num_classes}"
            )

    def random_pairs(self, rng: ClientRng) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, second), each (C,): one uniformly random pair of distinct classes per row."""
        u = rng.uniform(2)
        L = self.num_classes
        first = (u[:, 0] * L).long().clamp_(max=L - 1)
        # an offset in [1, L): the second class is uniform over the L - 1 others
        offset = 1 + (u[:, 1] * (L - 1)).long().clamp_(max=L - 2)
        return first, (first + offset) % L

    def poison_labels(self, labels: torch.Tensor, rng: ClientRng | None = None) -> torch.Tensor:
        """Labels (C, n) -> each row with its client's pair swapped (`rng`: one row per client)."""
        if rng is None:
            raise ValueError(
                f"{self.name} draws from the clients' attack streams: pass rng (one row per client)"
            )
        first, second = self.random_pairs(rng)
        return swap_classes(labels, first, second)
