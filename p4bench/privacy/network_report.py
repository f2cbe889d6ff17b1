"""Files of a network-DP result: the matrix as CSV and as a heatmap (matplotlib, Agg)."""

from __future__ import annotations

import csv
import math
import textwrap
from pathlib import Path

import numpy as np

from p4bench.privacy.network_dp import NetworkDP

__all__ = ["write_heatmap", "write_matrix_csv"]


def write_matrix_csv(result: NetworkDP, path: str | Path) -> Path:
    """epsilon(u -> v) with one row per u (the protected node) and one column per v (the
    observer); the header names the columns, the first column the row's u."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    epsilon = np.asarray(result.epsilon, dtype=float)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["u\\v", *range(epsilon.shape[1])])
        for u, row in enumerate(epsilon):
            writer.writerow([u, *("nan" if math.isnan(x) else f"{x:.6g}" for x in row)])
    return path


def write_heatmap(result: NetworkDP, path: str | Path, title: str = "") -> Path:
    """A PNG heatmap of epsilon(u -> v): rows u (protected), columns v (observer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    epsilon = np.asarray(result.epsilon, dtype=float)
    size = min(12.0, 3.0 + 0.15 * epsilon.shape[0])
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(np.ma.masked_invalid(epsilon), cmap="viridis", vmin=0.0)
    fig.colorbar(image, ax=ax, label=f"epsilon(u -> v) at delta = {result.delta:g}")
    ax.set_xlabel("observer v")
    ax.set_ylabel("protected node u")
    ax.set_title(textwrap.fill(title or "pairwise network DP", 60), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
