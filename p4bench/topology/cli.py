"""`p4bench topology show`: degree statistics, spectral gap and a drawing of a topology."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer

from p4bench.config import parse_key_values
from p4bench.errors import UsageError
from p4bench.topology.graphs import Topology, degree_stats, is_connected, is_symmetric
from p4bench.topology.mixing import metropolis_hastings, spectral_gap

app = typer.Typer(name="topology", help="Inspect communication topologies.", no_args_is_help=True)


def summarize(topology: Topology, adjacency: np.ndarray, round_index: int) -> dict[str, Any]:
    """Degrees, connectivity and, when this round's edges are symmetric, the MH gap.

    ``directed`` is the topology's nature; a directed topology can still produce a
    symmetric round (the exponential graph when the hop is M/2), and then gets a gap.
    """
    symmetric = is_symmetric(adjacency)
    directed = bool(topology.directed)
    return {
        "topology": topology.name,
        "clients": int(adjacency.shape[0]),
        "round": round_index,
        "time_varying": bool(topology.time_varying),
        "directed": directed,
        "edges": int(adjacency.sum()) if directed else int(np.triu(adjacency | adjacency.T, k=1).sum()),
        "connected": is_connected(adjacency),
        **degree_stats(adjacency),
        "spectral_gap_mh": spectral_gap(metropolis_hastings(adjacency)) if symmetric else None,
    }


def draw(adjacency: np.ndarray, path: Path, title: str, directed: bool | None = None) -> None:
    """Draw the graph on a circle with matplotlib (Agg backend) and save it as PNG.

    Edges get arrows when `directed` (default: when the adjacency is not symmetric).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = adjacency.shape[0]
    angle = 2 * np.pi * np.arange(m) / max(m, 1)
    xy = np.stack([np.cos(angle), np.sin(angle)], axis=1)
    directed = not is_symmetric(adjacency) if directed is None else directed
    fig, ax = plt.subplots(figsize=(6, 6))
    for i, j in zip(*np.nonzero(adjacency)):
        if directed:
            ax.annotate(
                "",
                xy=xy[j],
                xytext=xy[i],
                arrowprops={"arrowstyle": "-|>", "color": "0.4", "lw": 0.8, "shrinkA": 7, "shrinkB": 7},
            )
        elif i < j:
            ax.plot(*xy[[i, j]].T, color="0.4", lw=0.8, zorder=1)
    ax.scatter(*xy.T, s=120, color="tab:blue", zorder=2)
    if m <= 64:
        for k, (x, y) in enumerate(xy):
            ax.text(x, y, str(k), ha="center", va="center", fontsize=7, color="white", zorder=3)
    ax.set_title(title)
    ax.set_aspect("equal")
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def show_command(
    name: str = typer.Argument(..., help="topology name (see `p4bench list`)"),
    clients: int = typer.Option(..., "--clients", help="number of clients M"),
    round_index: int = typer.Option(0, "--round", help="round index (time-varying topologies)"),
    option: Optional[list[str]] = typer.Option(None, "--option", "-o", help="topology option KEY=VALUE, repeatable"),
    seed: int = typer.Option(0, "--seed", help="seed of the generator for random graphs"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="also draw the graph to this PNG file"),
    as_json: bool = typer.Option(False, "--json", help="end with one JSON line holding the statistics"),
) -> None:
    """Degree statistics and Metropolis-Hastings spectral gap of a topology at one round."""
    from p4bench.topology import get_topology

    if round_index < 0:
        raise UsageError(f"--round must be >= 0, got {round_index}")
    topology = get_topology(name, parse_key_values(option or []))
    adjacency = topology.edges(clients, round_index, np.random.default_rng(seed))
    stats = summarize(topology, adjacency, round_index)
    kind = "directed" if stats["directed"] else "undirected"
    timing = "time-varying" if stats["time_varying"] else "static"
    typer.echo(f"topology {name}: {clients} clients, round {round_index}, {kind}, {timing}")
    scope = " (this round)" if stats["time_varying"] else ""
    typer.echo(f"edges: {stats['edges']} ({kind}), connected{scope}: {'yes' if stats['connected'] else 'no'}")
    typer.echo(f"out-degree min/mean/max: {stats['out_min']}/{stats['out_mean']:.2f}/{stats['out_max']}")
    typer.echo(f"in-degree  min/mean/max: {stats['in_min']}/{stats['in_mean']:.2f}/{stats['in_max']}")
    if stats["spectral_gap_mh"] is None:
        typer.echo("spectral gap (Metropolis-Hastings): n/a, this round's edges are not symmetric")
    else:
        typer.echo(f"spectral gap (Metropolis-Hastings): {stats['spectral_gap_mh']:.4f}")
    if plot is not None:
        draw(adjacency, plot, f"{name}, M={clients}, round {round_index}", directed=stats["directed"])
        typer.echo(f"drawing saved to {plot}")
        stats["plot"] = str(plot)
    if as_json:
        typer.echo(json.dumps(stats))


app.command("show")(show_command)


def register(root: typer.Typer) -> None:
    """Add the `topology` command group to the root app."""
    root.add_typer(app, name="topology")
