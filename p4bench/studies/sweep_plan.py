"""What a sweep plans: its parsed spec, the runs it expands to, and their option keys.

Below `p4bench.studies.sweep` (which parses, expands and runs sweeps) and
`p4bench.studies.sweep_privacy` (a sweep's privacy checks), which both read these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from p4bench.config import FIELD_NAMES, RunConfig
from p4bench.errors import ConfigError

__all__ = [
    "LABEL",
    "REFERENCE",
    "VARIANT_TAGS",
    "SweepSpec",
    "PlannedRun",
    "option_key",
    "apply_option",
    "describe_run",
    "split_variant",
]

_OPTIONAL = {f.name for f in fields(RunConfig) if "None" in str(f.type)} - {"attack", "defense"}
LABEL = "label"  # a variant's label: the run's `variant` tag, not part of its config
# a variant's `reference` (text: why): its runs are declared reference rows, tag `reference`
# (a row of their own in a table, no claim uses them, and their epsilon may be uncertified:
# `p4bench.studies.equal_privacy`), not part of their config either
REFERENCE = "reference"
VARIANT_TAGS = {LABEL: "variant", REFERENCE: REFERENCE}  # variant key -> the tag it becomes


def option_key(key: str) -> str:
    """A run option's canonical name: a RunConfig field or `options.<plugin option>`."""
    name = str(key).replace("-", "_")
    if name.startswith("options."):
        return "options." + str(key)[len("options.") :]
    if name not in FIELD_NAMES:
        raise ConfigError(
            str(key),
            f"unknown run option; valid options: {', '.join(FIELD_NAMES)}, "
            "or options.<name> for a plugin option",
        )
    return name


def split_variant(variant: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A sweep variant as (its run options, the tags its `VARIANT_TAGS` keys give its runs)."""
    grid = {k: v for k, v in variant.items() if k not in VARIANT_TAGS}
    tags = {
        VARIANT_TAGS[k]: str(v) for k, v in variant.items() if k in VARIANT_TAGS and v is not None
    }
    return grid, tags


def apply_option(values: dict[str, Any], key: str, value: Any) -> None:
    """Set one option in a RunConfig keyword mapping (plugin options merge key by key)."""
    name = option_key(key)
    if name.startswith("options."):
        values.setdefault("options", {})[name[len("options.") :]] = value
    elif name == "options":
        if not isinstance(value, Mapping):
            raise ConfigError(
                "options", f"must be a mapping of option names to values, got {value!r}"
            )
        values.setdefault("options", {}).update(value)
    elif name in _OPTIONAL and isinstance(value, str) and value.strip().lower() in ("none", "null"):
        values[name] = None
    else:
        values[name] = value


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file (the format is in `p4bench.studies.sweep`'s docstring)."""

    name: str
    base: Mapping[str, Any] = field(default_factory=dict)
    axes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    variants: tuple[Mapping[str, Any], ...] = ()
    per_method: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def with_base(self, **changes: Any) -> SweepSpec:
        """This sweep with some base options replaced (e.g. from `--set` on the CLI)."""
        base = dict(self.base)
        for key, value in changes.items():
            base[key] = value
        return SweepSpec(self.name, base, self.axes, self.variants, self.per_method)


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its config and the tags it is logged with."""

    config: RunConfig
    tags: Mapping[str, str]

    @property
    def config_hash(self) -> str:
        return self.config.config_hash()


def describe_run(planned: PlannedRun, keys: Sequence[str] = ()) -> str:
    """A short human label of a run: method, attack, defense, the given keys, seed."""
    c = planned.config
    parts = [c.method]
    if c.attack:
        parts.append(f"attack={c.attack}")
    if c.defense is not None:
        parts.append(f"defense={c.defense}")
    for tag in ("variant", "tune_point"):
        if tag in planned.tags:
            parts.append(planned.tags[tag])
    if REFERENCE in planned.tags:  # a declared reference row (`REFERENCE`)
        parts.append("(reference)")
    for key in keys:
        name = option_key(key)
        value = (
            c.options.get(name[len("options.") :])
            if name.startswith("options.")
            else getattr(c, name)
        )
        parts.append(f"{key}={value}")
    parts.append(f"seed={c.seed}")
    return " ".join(parts)
