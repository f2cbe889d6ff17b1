"""What a `RunConfig` field accepts, and the check of a value against it.

Each field carries its help text and range in its metadata (`field_meta`); `check_field`
reads the value a YAML file or the command line gave (booleans and numbers as text too) and
refuses, naming the field and the range, whatever the field does not accept. Kept apart from
`p4bench.config` so that the config's fields stay readable there; both are imported without
torch, so that a bad value is refused before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from p4bench.errors import ConfigError

__all__ = ["check_field", "field_meta", "range_text"]


def field_meta(
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    choices: tuple[str, ...] | None = None,
    high_open: bool = False,
) -> dict[str, Any]:
    return dict(help=help, low=low, high=high, choices=choices) | {
        "low_open": low_open,
        "high_open": high_open,
    }


def check_field(f: dataclasses.Field[Any], value: Any) -> Any:
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f.name, "a value is required")
    if f.name in ("attack", "defense") and isinstance(value, str) and value.lower() == "none":
        # "none" is explicit: for the defense it overrides a method's default defense
        return None if f.name == "attack" else "none"
    base = str(f.type).replace(" | None", "")
    meta = f.metadata
    if base == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f.name, f"must be true or false, got {value!r}")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "int":
        if not number or float(value) != int(value):
            raise ConfigError(f.name, f"must be an integer{range_text(meta)}, got {value!r}")
        value = int(value)
    elif base == "float":
        if not number or not math.isfinite(value):
            raise ConfigError(f.name, f"must be a number{range_text(meta)}, got {value!r}")
        value = float(value)
    elif base == "str":
        if not isinstance(value, str) or not value:
            raise ConfigError(f.name, f"must be a non-empty string, got {value!r}")
        if meta["choices"] and value not in meta["choices"]:
            raise ConfigError(f.name, f"must be one of {', '.join(meta['choices'])}, got {value!r}")
        return value
    else:  # options
        if not isinstance(value, Mapping):
            raise ConfigError(f.name, f"must be a mapping of option names to values, got {value!r}")
        return value
    low, high = meta["low"], meta["high"]
    too_low = low is not None and (value <= low if meta["low_open"] else value < low)
    too_high = high is not None and (value >= high if meta["high_open"] else value > high)
    if too_low or too_high:
        raise ConfigError(f.name, f"must be{range_text(meta)}, got {value!r}")
    return value


def range_text(meta: Mapping[str, Any]) -> str:
    low, high = meta["low"], meta["high"]
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if meta['low_open'] else '>='} {number_text(low)}"
    opening, closing = "(" if meta["low_open"] else "[", ")" if meta["high_open"] else "]"
    return f" in {opening}{number_text(low)}, {number_text(high)}{closing}"


def number_text(x: float) -> str:
    return f"{int(x):_}" if float(x).is_integer() else f"{x:g}"
