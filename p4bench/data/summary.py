"""What datasets are present and how a partition spreads classes over clients (tables, heatmap).

Library functions behind `p4bench data info | partition` and the run tracker's
`partition.png`; the commands themselves are in `p4bench.cli.data`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["dataset_status", "partition_counts", "plot_partition_heatmap"]


def dataset_status(root: Path, registry: Any) -> list[dict[str, Any]]:
    """Every dataset in `registry` (a `p4bench.host.manager.Registry`): name, whether
    its files are present under `root`, and where they go."""
    rows = []
    for entry in registry.entries("dataset"):
        instance = entry.cls()
        location = instance.location(root) if hasattr(instance, "location") else None
        present = bool(instance.is_present(root)) if hasattr(instance, "is_present") else True
        rows.append(
            {
                "name": entry.name,
                "present": present,
                "path": str(location) if location is not None else None,
                "description": entry.description,
            }
        )
    return rows


def partition_counts(
    partition: list[np.ndarray], labels: np.ndarray, num_classes: int
) -> np.ndarray:
    """(clients, classes) sample counts of a partition."""
    if not partition:
        return np.zeros((0, num_classes), np.int64)
    return np.stack([np.bincount(labels[np.asarray(p)], minlength=num_classes) for p in partition])


def plot_partition_heatmap(
    counts: np.ndarray, class_names: tuple[str, ...], path: Path, title: str = ""
) -> None:
    """Client-by-class heatmap of sample counts, written as a PNG (Agg canvas, no display)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    clients, classes = counts.shape
    figure = Figure(figsize=(min(4 + 0.25 * classes, 30), min(3 + 0.06 * clients, 30)))
    axes = figure.add_subplot()
    image = axes.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    figure.colorbar(image, ax=axes, label="samples")
    axes.set_xlabel("class")
    axes.set_ylabel("client")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))  # clients are whole: no tick at 2.5
    if classes <= 50:
        axes.set_xticks(
            range(classes), labels=list(class_names), fontsize=7, rotation=90 if classes > 20 else 0
        )
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
