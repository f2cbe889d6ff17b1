"""Degree statistics, connectivity, spectral gap and a drawing of one round of a topology.

Library functions behind `p4bench topology show` (`p4bench.cli.topology`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from p4bench.topology.graphs import Topology, degree_stats, is_connected, is_symmetric
from p4bench.topology.mixing import metropolis_hastings, spectral_gap

__all__ = ["summarize", "draw"]


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
        "edges": int(adjacency.sum())
        if directed
        else int(np.triu(adjacency | adjacency.T, k=1).sum()),
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
                arrowprops={
                    "arrowstyle": "-|>",
                    "color": "0.4",
                    "lw": 0.8,
                    "shrinkA": 7,
                    "shrinkB": 7,
                },
            )
        elif i < j:
            ax.plot(*xy[[i, j]].T, color="0.4", lw=0.8, zorder=1)
    ax.scatter(xy[:, 0], xy[:, 1], s=120, color="tab:blue", zorder=2)
    if m <= 64:
        for k, (x, y) in enumerate(xy):
            ax.text(x, y, str(k), ha="center", va="center", fontsize=7, color="white", zorder=3)
    ax.set_title(title)
    ax.set_aspect("equal")
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
