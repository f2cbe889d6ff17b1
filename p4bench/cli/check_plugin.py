"""`p4bench check-plugin DIST`: every plugin an installed distribution registers, built
and checked at small size (`p4bench.testing.distribution`); one line per problem."""

from __future__ import annotations

import json

import typer


def check_plugin_command(
    distribution: str = typer.Argument(
        ..., help="an installed distribution, e.g. p4bench-gossip (see `p4bench list`)"
    ),
    as_json: bool = typer.Option(
        False, "--json", help="end with one JSON object: problems and what was checked"
    ),
) -> None:
    """Check every plugin of an installed package: loading, registration, the conformance kit
    (methods, attacks, defenses), topologies built with their defaults, deprecated API calls.
    Exit 1 when anything is wrong, one line per problem."""
    from p4bench.testing.distribution import check_distribution

    report = check_distribution(distribution)
    typer.echo(f"{report.distribution} {report.version}")
    for line in report.checked:
        typer.echo(f"  {line}")
    for line in report.problems:
        typer.echo(f"problem: {line}")
    verdict = "passes" if report.passed else f"{len(report.problems)} problem(s)"
    typer.echo(f"{report.distribution}: {verdict}")
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "distribution": report.distribution,
                    "version": report.version,
                    "problems": report.problems,
                    "checked": report.checked,
                }
            )
        )
    if not report.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("check-plugin")(check_plugin_command)
