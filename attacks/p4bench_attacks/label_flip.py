"""Label flipping (Tolpegin et al. 2020): malicious clients train on poisoned labels.

Default, as in the P4 paper: every label c becomes L - 1 - c. Option `label_map` gives
an explicit mapping instead, either as {from: to} (classes not named keep their label,
e.g. ``-o 'label_map={3: 9, 2: 1}'`` as in FedSecurity's example) or as a list of L
targets (class c becomes label_map[c]). The labels are poisoned once, before any
training, so the attack is active from the first phase on (the paper's label flipping is
always "before grouping"); option `attack_timing` does not apply to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine import Attack
from p4bench.errors import ConfigError
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig

_FIELD = "options.label_map"


def class_index(value: Any, num_classes: int, field: str = _FIELD) -> int:
    """`value` as a class index in [0, L), accepting ints and integer strings (YAML keys);
    ConfigError naming option `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(field, f"classes must be integers, got {value!r}")
    try:
        index = int(value)
    except ValueError:
        raise ConfigError(field, f"classes must be integers, got {value!r}") from None
    if not 0 <= index < num_classes:
        raise ConfigError(field, f"classes must be in [0, {num_classes - 1}], got {value!r}")
    return index


def label_mapping(spec: Any, num_classes: int) -> torch.Tensor:
    """(L,) int64 table: poisoned label of each class, from the `label_map` option."""
    if spec is None:
        return torch.arange(num_classes - 1, -1, -1)
    mapping = torch.arange(num_classes)
    if isinstance(spec, Mapping):
        for source, target in spec.items():
            mapping[class_index(source, num_classes)] = class_index(target, num_classes)
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) != num_classes:
            raise ConfigError(
                _FIELD,
                f"a list must name a target for each of the {num_classes} classes, got {len(spec)}",
            )
        mapping = torch.tensor([class_index(target, num_classes) for target in spec])
    else:
        raise ConfigError(
            _FIELD,
            f"must be a mapping {{from: to}} or a list of {num_classes} targets, got {spec!r}",
        )
    return mapping


class LabelFlip(Attack):
    """Every label c becomes L - 1 - c, or follows option `label_map`."""

    name = "label-flip"
    description = "data poisoning: malicious clients train on flipped labels (c -> L-1-c, or option label_map)"
    options = Attack.options + (
        Option(
            "label_map",
            object,
            None,
            "explicit flips: a mapping {from: to} (other classes keep their label) "
            "or a list of L targets; default: c -> L-1-c",
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.mapping = label_mapping(self.option_values["label_map"], num_classes)

    def poison_labels(self, labels: torch.Tensor) -> torch.Tensor:
        valid = (labels >= 0) & (labels < self.num_classes)  # leave padding values untouched
        return torch.where(valid, self.mapping[labels.clamp(0, self.num_classes - 1)], labels)
