"""Declared plugin options: what `-o key=value`, a YAML `options:` mapping or a sweep's
`options.<name>` may set, checked once for the whole run before any data is loaded.

Every plugin class declares `options: ClassVar[tuple[Option, ...]]`. A plugin reads its
typed values with `resolve_options(self.options, config.options)`, which fills defaults
and converts strings (`"4"` -> 4, `"true"` -> True); keys it does not declare belong to
the run's other plugins and are ignored there. `validate_run_options` is the host-side
check: every key must be declared by a plugin the run uses, every value must fit.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p4bench.errors import ConfigError, UsageError
from p4bench.host.legacy import option_help_options, pass_undeclared  # p4bench 0.1 plugins

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = [
    "Option",
    "UnknownOptionError",
    "declared_options",
    "resolve_options",
    "run_plugins",
    "validate_run_options",
    "validate_planned",
    "option_params",
    "option_rows",
    "option_rows_of",
    "option_reference",
    "topology_options",
]

# `object`: any YAML value, checked by the plugin itself (e.g. label_map: a mapping or a list)
_TYPES = {bool: "bool", int: "int", float: "float", str: "str", dict: "mapping", object: "any"}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class Option:
    """One plugin option. `default` None means "computed by the plugin" (its `help` says
    how) or "not set"; giving null (`-o key=null`) also selects the default.
    `low`/`high` bound numbers (open ends with `low_open`/`high_open`); `choices`
    lists the allowed values. `paper`: where the default is the method's paper's own value
    (e.g. "Alg. 2", "Table II"), shown by `describe` and the option reference; empty: the
    suite's choice (a gap in the paper, or a smaller default for a laptop)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    paper: str = ""

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(
                f"option {self.name!r}: type must be one of {', '.join(t.__name__ for t in _TYPES)}"
            )

    @property
    def type_name(self) -> str:
        return _TYPES[self.type]

    def range_text(self) -> str:
        """The allowed values in words: "one of a, b", "in [0, 1)", ">= 1", or ""."""
        if self.choices:
            return "one of " + ", ".join(_text(c) for c in self.choices)
        low, high = self.low, self.high
        if low is None:
            return "" if high is None else f"{'<' if self.high_open else '<='} {_num(high)}"
        if high is None:
            return f"{'>' if self.low_open else '>='} {_num(low)}"
        return f"in {'(' if self.low_open else '['}{_num(low)}, {_num(high)}{')' if self.high_open else ']'}"

    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        kind = {
            "bool": "true or false",
            "int": "an integer",
            "float": "a number",
            "str": "a string",
            "mapping": "a mapping",
            "any": "a value",
        }[self.type_name]
        limits = self.range_text()
        if self.choices:
            return limits
        return f"{kind} {limits}" if limits else kind

    def resolve(self, value: Any, field: str) -> Any:
        """`value` converted to this option's type and checked; None selects the default."""
        if value is None:
            return self.default
        converted = _convert(self.type, value)
        if converted is _BAD:
            raise ConfigError(field, f"must be {self.expected()}, got {value!r}")
        if self.choices and converted not in self.choices:
            raise ConfigError(field, f"must be {self.expected()}, got {value!r}")
        if self.type in (int, float) and not _within(self, converted):
            raise ConfigError(field, f"must be {self.expected()}, got {value!r}")
        return converted


def topology_options(default: str, choices: tuple[str, ...] | None = None) -> tuple[Option, Option]:
    """The options of a method that communicates over a graph of the shared topology
    harness: `topology` (a topology plugin; `p4bench run --topology NAME`) and
    `topology_options` (its own options; `--topology-option KEY=VALUE`). `choices`
    restricts the graphs the method can use (default: every registered topology)."""
    listed = f" ({', '.join(choices)})" if choices else " (see `p4bench list`)"
    return (
        Option(
            "topology",
            str,
            default,
            f"communication graph: a topology plugin{listed}; run --topology",
            choices=choices,
        ),
        Option(
            "topology_options",
            dict,
            None,
            "the topology's own options, e.g. {k: 4}; run --topology-option",
        ),
    )


class UnknownOptionError(ConfigError):
    """A key no plugin of the run declares; the message lists the valid keys."""

    def __init__(self, field: str, message: str) -> None:
        UsageError.__init__(self, f"{field}: {message}")
        self.field = field


_BAD = object()


def _convert(kind: type, value: Any) -> Any:
    """`value` as `kind`, or _BAD. Strings are parsed: `-o` values may arrive as text."""
    if kind is object:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        text = str(value).strip().lower() if isinstance(value, str) else None
        return True if text in _TRUE else False if text in _FALSE else _BAD
    if kind is dict:
        return dict(value) if isinstance(value, Mapping) else _BAD
    if kind is str:
        if isinstance(value, bool):  # YAML reads `on`/`off`/`true` as booleans
            return "true" if value else "false"
        return str(value) if isinstance(value, (str, int, float)) else _BAD
    if isinstance(value, bool):
        return _BAD
    if isinstance(value, str):
        try:
            value = (
                float(value.strip())
                if kind is float or not value.strip().lstrip("+-").isdigit()
                else int(value)
            )
        except ValueError:
            return _BAD
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return _BAD
    if kind is int:
        return int(value) if float(value).is_integer() else _BAD
    return float(value)


def _within(option: Option, value: float) -> bool:
    low, high = option.low, option.high
    if low is not None and (value <= low if option.low_open else value < low):
        return False
    return not (high is not None and (value >= high if option.high_open else value > high))


def _num(x: float) -> str:
    return f"{int(x)}" if float(x).is_integer() else f"{x:g}"


def _text(value: Any) -> str:
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def resolve_options(
    declared: Sequence[Option],
    given: Mapping[str, Any],
    *,
    strict: bool = False,
    prefix: str = "options.",
    owner: str = "",
) -> dict[str, Any]:
    """Typed values of the `declared` options: each given value converted and checked,
    defaults filled. Keys not declared are ignored (they belong to the run's other
    plugins) unless `strict`, which refuses them (naming `owner`, e.g. "topology 'ring'").
    Errors are ConfigErrors naming `prefix + key`, the value and what was expected."""
    given = given or {}
    if strict:
        names = [o.name for o in declared]
        for key in given:
            if key not in names:
                of = f" of {owner}" if owner else ""
                raise UnknownOptionError(
                    f"{prefix}{key}", f"unknown option{of}{_suggest(str(key), names)}"
                )
    return {o.name: o.resolve(given.get(o.name), f"{prefix}{o.name}") for o in declared}


def _suggest(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    listed = f"valid: {', '.join(sorted(valid)) or '(none)'}"
    return f"; did you mean {close[0]}? {listed}" if close else f"; {listed}"


def declared_options(cls: Any) -> tuple[Option, ...]:
    """A plugin class's declarations (before `options`: none, or a topology's `option_help`)."""
    return tuple(getattr(cls, "options", ()) or ()) or option_help_options(cls, Option)


def run_plugins(config: RunConfig, registry: Any) -> list[tuple[str, str, type]]:
    """(kind, name, class) of every plugin `config` uses, the method's default defense
    included; unknown names raise UnknownNameError."""
    method = registry.get("method", config.method)
    used = [("method", config.method, method)]
    if config.attack:
        used.append(("attack", config.attack, registry.get("attack", config.attack)))
    defense = (
        config.defense if config.defense is not None else getattr(method, "default_defense", None)
    )
    if defense not in (None, "none"):
        used.append(("defense", defense, registry.get("defense", defense)))
    for kind in ("dataset", "partitioner", "model", "runtime", "accountant"):
        name = getattr(config, kind)
        used.append((kind, name, registry.get(kind, name)))
    return used


def validate_run_options(config: RunConfig, registry: Any) -> dict[str, dict[str, Any]]:
    """Resolved options of every plugin `config` uses, keyed by kind ("method",
    "defense", ..., and "topology" for the graph a `topology` option names, with its
    `topology_options`). Refuses, before any data is loaded, keys no used plugin
    declares (UnknownOptionError: the valid keys and a close match) and bad values."""
    used = run_plugins(config, registry)
    owners: dict[str, list[str]] = {}
    for kind, name, cls in used:
        for option in declared_options(cls):
            owners.setdefault(option.name, []).append(f"{kind} {name}")
    for key in pass_undeclared(config.options, owners, used, registry):  # 0.1 plugins: warned
        plugins = ", ".join(f"{kind} {name}" for kind, name, _ in used)
        raise UnknownOptionError(
            f"options.{key}",
            f"unknown option for this run ({plugins}){_elsewhere(str(key), registry)}"
            f"{_suggest(str(key), list(owners))}",
        )
    resolved = {
        kind: resolve_options(declared_options(cls), config.options) for kind, _, cls in used
    }
    for values in list(resolved.values()):
        if isinstance(values.get("topology"), str):  # a graph plugin and its own options
            graph = registry.get("topology", values["topology"])
            resolved["topology"] = resolve_options(
                declared_options(graph),
                values.get("topology_options") or {},
                strict=True,
                prefix="options.topology_options.",
                owner=f"topology '{values['topology']}'",
            )
    return resolved


def validate_planned(
    runs: Iterable[Any], registry: Any, describe: Callable[[Any], str] | None = None
) -> None:
    """`validate_run_options` for every planned run (objects with a `config`), so that a
    study fails before its first run; `describe(run)` names the failing run."""
    for run in runs:
        try:
            validate_run_options(run.config, registry)
        except ConfigError as exc:
            if describe is not None:
                exc.args = (f"{exc} (in the run {describe(run)})",)
            raise


def _kinds(registry: Any) -> list[str]:
    """The registry's plugin kinds in its order. (This module sits below the plugin
    manager, which imports the plugin bases that import it, so it cannot import KINDS.)"""
    return [kind for kind in registry.as_dict() if kind != "problems"]


def _elsewhere(key: str, registry: Any) -> str:
    """Which registered plugins declare `key`, when the run uses none of them."""
    found = [
        f"{kind} {e.name}"
        for kind in _kinds(registry)
        for e in registry.entries(kind)
        if any(o.name == key for o in declared_options(e.cls))
    ]
    return (
        f"; it is an option of {', '.join(found[:4])}{', ...' if len(found) > 4 else ''}"
        if found
        else ""
    )


def option_params(resolved: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """MLflow params `option.<key>` of resolved options (`option.topology_options.<key>`
    for the graph's); strings as they are, other values as JSON."""
    params: dict[str, str] = {}
    for kind, values in resolved.items():
        for key, value in values.items():
            name = f"option.topology_options.{key}" if kind == "topology" else f"option.{key}"
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            params[name] = "none" if value is None else text
    return params


def option_rows(cls: Any) -> list[tuple[str, str, str, str, str]]:
    """(name, type, default, range or choices, help) of each declared option of `cls`."""
    return [(o.name, *option_rows_of(o)) for o in declared_options(cls)]


def option_rows_of(option: Option) -> tuple[str, str, str, str]:
    """(type, default, range or choices, help) of one option, as text ("-": no fixed default)."""
    return (
        option.type_name,
        "-" if option.default is None else _text(option.default),
        option.range_text(),
        option.help,
    )


def option_reference(registry: Any) -> str:
    """Markdown tables of every registered plugin's options, one table per kind; an
    option several plugins declare alike (e.g. inherited) is one row naming them all."""
    lines: list[str] = []
    for kind in _kinds(registry):
        entries = registry.entries(kind)
        rows: dict[str, tuple[Option, list[str]]] = {}  # by repr: a default may be unhashable
        for entry in entries:
            for option in declared_options(entry.cls):
                rows.setdefault(repr(option), (option, []))[1].append(f"`{entry.name}`")
        if not rows:
            continue
        without = [f"`{e.name}`" for e in entries if not declared_options(e.cls)]
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        title = f"**{plural.capitalize()}.**" + (
            f" Without options: {', '.join(without)}." if without else ""
        )
        lines += [
            title,
            "",
            "| option | of | type | default | allowed | help |",
            "|---|---|---|---|---|---|",
        ]
        for option, owners in rows.values():
            of = f"every {kind}" if len(owners) == len(entries) > 1 else ", ".join(owners)
            type_name, default, allowed, text = option_rows_of(option)
            cells = [
                f"`{option.name}`",
                of,
                type_name,
                default + (f" (paper: {option.paper})" if option.paper else ""),
                allowed,
                text,
            ]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
