"""`p4bench describe NAME`: one plugin's kind, origin, capabilities and declared options."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p4bench.errors import UsageError
from p4bench.host.manager import KINDS, Entry, default_registry
from p4bench.options import declared_options, option_rows

__all__ = ["capabilities", "describe", "describe_command", "find_entries", "register", "show"]

# Class attributes that say what a plugin of each kind needs or does (methods also
# show their `Capabilities`).
TRAITS: dict[str, tuple[str, ...]] = {
    "method": ("default_defense", "default_epsilon", "default_neighbouring"),
    "attack": ("needs_individual_updates", "omniscient"),
    "defense": ("needs_individual_updates", "filters", "uses_identities", "needs_oracle"),
    "dataset": ("uses_run_config",),
    "partitioner": ("needs_writers",),
    "topology": ("time_varying", "directed"),
    "accountant": ("relations", "uses_rounds"),
    "runtime": ("separate_parties",),
}


def find_entries(name: str, kind: str | None = None, registry: Any = None) -> list[Entry]:
    """The registered plugins called `name` (of `kind` when given); a UsageError listing
    the registered names (and a close match) when there is none."""
    registry = registry or default_registry()
    if kind is not None and kind not in KINDS:
        raise UsageError(f"unknown kind '{kind}'; kinds: {', '.join(KINDS)}")
    kinds = [kind] if kind else list(KINDS)
    found = [e for k in kinds for e in registry.entries(k) if e.name == name]
    if not found:
        names = sorted({e.name for k in kinds for e in registry.entries(k)})
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown plugin '{name}'{hint}; registered: {', '.join(names)}")
    return found


def capabilities(entry: Entry, registry: Any = None) -> dict[str, Any]:
    """What the plugin declares about itself: a method's `Capabilities` and defaults; for
    attacks and defenses their needs and the registered methods they can be used with."""
    cls, values = entry.cls, {}
    caps = getattr(cls, "capabilities", None)
    if entry.kind == "method" and dataclasses.is_dataclass(caps) and not isinstance(caps, type):
        values.update(dataclasses.asdict(caps))
    for attr in TRAITS.get(entry.kind, ()):
        if hasattr(cls, attr):
            value = getattr(cls, attr)
            values[attr] = list(value) if isinstance(value, tuple) else value
    if entry.kind == "attack":
        values["tampers_with_messages"] = "tamper" in _overridden(cls)
        values["poisons_labels"] = "poison_labels" in _overridden(cls)
    if entry.kind in ("attack", "defense") and hasattr(cls, "incompatibility"):
        registry = registry or default_registry()
        methods = registry.entries("method")
        values["usable_with"] = [
            m.name for m in methods if cls.incompatibility(m.cls.capabilities) is None
        ]
    return values


def _overridden(cls: type) -> set[str]:
    """Methods of `cls` defined below the kind's base class (Attack)."""
    from p4bench.engine.threats import Attack, ModelReplacementAttack

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (Attack, object):
            break
        names.update(klass.__dict__)
        if klass is ModelReplacementAttack:
            names.add("tamper")
    return names


def describe(entry: Entry, registry: Any = None) -> dict[str, Any]:
    """The plugin as a JSON-serialisable mapping."""
    return {
        "name": entry.name,
        "kind": entry.kind,
        "distribution": entry.distribution,
        "version": entry.version,
        "class": f"{entry.cls.__module__}.{entry.cls.__qualname__}",
        "description": entry.description,
        "capabilities": capabilities(entry, registry),
        "options": [
            {
                **dict(zip(("name", "type", "default", "allowed", "help"), row)),
                "paper": option.paper,
            }
            for row, option in zip(option_rows(entry.cls), declared_options(entry.cls))
        ],
    }


def _print(console: Console, info: dict[str, Any]) -> None:
    console.print(
        f"[bold]{escape(info['name'])}[/bold] ({info['kind']}) from {escape(info['distribution'])} "
        f"{escape(info['version'])}  [dim]{escape(info['class'])}[/dim]",
        highlight=False,
    )
    if info["description"]:
        console.print(escape(info["description"]), highlight=False)
    if info["capabilities"]:
        console.print("[bold]capabilities[/bold]")
        for key, value in info["capabilities"].items():
            shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            console.print(f"  {key}: {escape(shown) or '(none)'}", highlight=False, soft_wrap=True)
    if not info["options"]:
        console.print("no options")
        return
    table = Table(title=f"options of {escape(info['name'])} (-o key=value)")
    for column in ("name", "type", "default", "allowed", "help"):
        table.add_column(column, overflow="fold")
    for option in info["options"]:
        default = option["default"] + (
            f" (paper: {option['paper']})" if option.get("paper") else ""
        )
        table.add_row(
            *(
                escape(text)
                for text in (
                    option["name"],
                    option["type"],
                    default,
                    option["allowed"],
                    option["help"],
                )
            )
        )
    console.print(table)
    if any(option.get("paper") for option in info["options"]):
        console.print(
            "(paper: ...) marks a default that is the paper's own value; the others are the suite's choice",
            highlight=False,
        )


def describe_command(
    name: str = typer.Argument(..., help="plugin name, e.g. p4, m-krum, shards"),
    kind: str | None = typer.Option(None, "--kind", help=f"only this kind: {', '.join(KINDS)}"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list, one object per match"),
) -> None:
    """Show a plugin's kind, origin, capabilities and options (name, type, default, range, help)."""
    show(name, kind, as_json)


def show(name: str, kind: str | None = None, as_json: bool = False) -> None:
    """Print every plugin called `name` (the body of `describe` and `list NAME`)."""
    from p4bench.cli.problems import warn_plugin_problems

    registry = default_registry()
    warn_plugin_problems()
    infos = [describe(entry, registry) for entry in find_entries(name, kind, registry)]
    if as_json:
        typer.echo(json.dumps(infos, default=str))
        return
    console = Console()
    for index, info in enumerate(infos):
        if index:
            console.print()
        _print(console, info)


def register(app: typer.Typer) -> None:
    app.command("describe")(describe_command)
