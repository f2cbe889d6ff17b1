"""`p4bench topology show`: degree statistics, spectral gap and a drawing of a topology
(an adapter over `p4bench.topology.summary`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from p4bench.errors import UsageError

app = typer.Typer(name="topology", help="Inspect communication topologies.", no_args_is_help=True)


def show_command(
    name: str = typer.Argument(..., help="topology name (see `p4bench list`)"),
    clients: int = typer.Option(..., "--clients", help="number of clients M"),
    round_index: int = typer.Option(0, "--round", help="round index (time-varying topologies)"),
    option: list[str] | None = typer.Option(
        None, "--option", "-o", help="topology option KEY=VALUE, repeatable"
    ),
    seed: int = typer.Option(0, "--seed", help="seed of the generator for random graphs"),
    plot: Path | None = typer.Option(None, "--plot", help="also draw the graph to this PNG file"),
    as_json: bool = typer.Option(
        False, "--json", help="end with one JSON line holding the statistics"
    ),
) -> None:
    """Degree statistics and Metropolis-Hastings spectral gap of a topology at one round."""
    import numpy as np

    from p4bench.config import parse_key_values
    from p4bench.host.manager import default_registry
    from p4bench.run.preflight import check_plot_path
    from p4bench.topology import get_topology
    from p4bench.topology.summary import draw, summarize

    if round_index < 0:
        raise UsageError(f"--round must be >= 0, got {round_index}")
    if plot is not None:
        check_plot_path(plot)  # before any work: a path that cannot be written is one line, exit 2
    topology = get_topology(name, parse_key_values(option or []), registry=default_registry())
    adjacency = topology.edges(clients, round_index, np.random.default_rng(seed))
    stats = summarize(topology, adjacency, round_index)
    kind = "directed" if stats["directed"] else "undirected"
    timing = "time-varying" if stats["time_varying"] else "static"
    typer.echo(f"topology {name}: {clients} clients, round {round_index}, {kind}, {timing}")
    scope = " (this round)" if stats["time_varying"] else ""
    typer.echo(
        f"edges: {stats['edges']} ({kind}), connected{scope}: {'yes' if stats['connected'] else 'no'}"
    )
    typer.echo(
        f"out-degree min/mean/max: {stats['out_min']}/{stats['out_mean']:.2f}/{stats['out_max']}"
    )
    typer.echo(
        f"in-degree  min/mean/max: {stats['in_min']}/{stats['in_mean']:.2f}/{stats['in_max']}"
    )
    if stats["spectral_gap_mh"] is None:
        typer.echo("spectral gap (Metropolis-Hastings): n/a, this round's edges are not symmetric")
    else:
        typer.echo(f"spectral gap (Metropolis-Hastings): {stats['spectral_gap_mh']:.4f}")
    if plot is not None:
        draw(
            adjacency, plot, f"{name}, M={clients}, round {round_index}", directed=stats["directed"]
        )
        typer.echo(f"drawing saved to {plot}")
        stats["plot"] = str(plot)
    if as_json:
        typer.echo(json.dumps(stats))


app.command("show")(show_command)


def register(root: typer.Typer) -> None:
    """Add the `topology` command group to the root app."""
    root.add_typer(app, name="topology")
