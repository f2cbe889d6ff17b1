"""Metrics by participation count, P4L's x-axis: the value at r averages, over the
reported peers that took part in at least r completed synergies, each peer's test
metric right after its r-th participation (the first round whose report counts >= r).

A method opts in by reporting a per-client count named `count_*` (`client_accuracies`,
e.g. p4l's `count_synergies`); its test loss and AUC come from `Method.test_metrics`.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from p4bench.records import RoundReport

COUNT_PREFIX = "count_"
COLUMNS = ("r", "peers", "accuracy", "loss", "auc")


def count_name(reports: Sequence[RoundReport]) -> str | None:
    """The participation count the reports carry, or None."""
    for report in reports[-1:]:
        for name in report.extra_accuracy:
            if name.startswith(COUNT_PREFIX):
                return name
    return None


def participation_curve(
    reports: Sequence[RoundReport], reported: np.ndarray
) -> list[dict[str, float]]:
    """One row per participation count r >= 1 reached by a reported peer (`COLUMNS`);
    none where no reported peer has a measured value (NaN: not evaluated)."""
    name = count_name(reports)
    if name is None or not reports:
        return []
    counts = np.stack([r.extra_accuracy[name] for r in reports])[:, reported]  # (rounds, peers)
    values = {
        "accuracy": np.stack([r.accuracy for r in reports])[:, reported],
        "loss": np.stack(
            [r.extra_accuracy.get("test_loss", np.full(len(r.accuracy), np.nan)) for r in reports]
        )[:, reported],
        "auc": np.stack(
            [r.extra_accuracy.get("test_auc", np.full(len(r.accuracy), np.nan)) for r in reports]
        )[:, reported],
    }
    rows = []
    top = int(np.nanmax(counts)) if counts.size else 0
    for r in range(1, top + 1):
        reached = counts >= r
        peers = reached.any(axis=0)
        first = reached.argmax(axis=0)[peers]  # the round of each peer's r-th participation
        columns = np.flatnonzero(peers)
        row = {"r": float(r), "peers": float(len(columns))}
        for key, table in values.items():
            picked = table[first, columns]
            row[key] = float(np.nanmean(picked)) if np.isfinite(picked).any() else float("nan")
        rows.append(row)
    # no value measured at all (a tuning run withholds the reported peers' tests): no curve
    return rows if any(np.isfinite(row[key]) for row in rows for key in values) else []


def write_participation_curve(rows: list[dict[str, float]], folder: Path, title: str) -> list[Path]:
    """`participation_curve.csv` and `participation_curve.png` (accuracy, loss and AUC
    against r); nothing when there are no rows."""
    if not rows:
        return []
    table = folder / "participation_curve.csv"
    with open(table, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(
            {k: (int(v) if k in ("r", "peers") else v) for k, v in row.items()} for row in rows
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = [row["r"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=100)
    for axis, key in zip(axes, ("accuracy", "loss", "auc")):
        axis.plot(r, [row[key] for row in rows], marker="o", markersize=3)
        axis.set_xlabel("participation count r (peers with >= r synergies)")
        axis.set_ylabel(f"test {key}")
        axis.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    figure = folder / "participation_curve.png"
    fig.savefig(figure)
    plt.close(fig)
    return [table, figure]
