"""`p4bench list`: every registered plugin by kind, with where it comes from, and the
problems of installed plugins that are (partly) not used."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p4bench.host.manager import KINDS, PluginProblem


def list_plugins(
    name: str | None = typer.Argument(
        None, help="show one plugin in detail (as `p4bench describe NAME`)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object keyed by kind"),
) -> None:
    """Show every registered method, attack, defense, dataset, ... and its distribution."""
    if name is not None:
        from p4bench.cli.describe import show

        return show(name, as_json=as_json)
    from p4bench.cli.plugin_cache import cached_listing
    from p4bench.cli.problems import warn_listed_problems

    listing, key = (
        cached_listing()
    )  # no plugin imports when the cache is current (`p4bench.cli.plugin_cache`)
    warn_listed_problems(listing["problems"], key)
    if as_json:
        typer.echo(
            json.dumps(listing)
        )  # includes "problems": [{distribution, version, kind, name, message}]
        return
    table = Table(title="registered plugins")
    for column in ("kind", "name", "distribution", "version", "description"):
        table.add_column(column)
    for kind in KINDS:
        for entry in listing.get(kind, []):
            table.add_row(
                kind, entry["name"], entry["distribution"], entry["version"], entry["description"]
            )
    console = Console()
    console.print(table)
    problems = [PluginProblem(**problem) for problem in listing["problems"]]
    if problems:
        console.print(
            f"[yellow]{len(problems)} plugin problem(s)[/yellow] (those parts are not used):"
        )
        for problem in problems:
            console.print(f"  {escape(problem.line())}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("list")(list_plugins)
