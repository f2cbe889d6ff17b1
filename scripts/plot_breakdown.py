"""Draw the gossip breakdown figure of docs/defenses.md from `p4bench compare` output.

Usage:
    p4bench compare --experiment gossip-breakdown \
        --group-by options.topology,variant,defense --format csv | tee table.csv
    python scripts/plot_breakdown.py table.csv docs/img/gossip-breakdown.png

One panel per graph (ordered by the `--order` list, sparse to dense), the attackers on the
x axis (the number in each variant label's percentage of the run's clients), one line per
defense, and the 95% t interval over seeds as error bars. `compare --plot` draws every
group of a 60-group study in one panel; this figure keeps the study's two axes apart so a
reader can see where each rule breaks.
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

DEFAULT_ORDER = ("ring", "erdos-renyi", "torus", "complete")
DEFENSE_ORDER = ("none", "median", "m-krum", "clipped-gossip", "nna")


def attackers(variant: str, clients: int) -> int:
    """Malicious nodes of a variant label ("no attack", "dissensus 12.5%")."""
    match = re.search(r"([0-9.]+)%", variant)
    return 0 if match is None else round(float(match.group(1)) / 100 * clients)


def read_rows(
    path: Path, clients: int
) -> dict[tuple[str, str], list[tuple[int, float, float, int]]]:
    """(topology, defense) -> [(attackers, mean, ci95 half width, seeds)] sorted by attackers."""
    lines: dict[tuple[str, str], list[tuple[int, float, float, int]]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            topology = row["options.topology"].strip('"')
            half = float(row["ci95_half"]) if row.get("ci95_half") not in (None, "", "nan") else 0.0
            point = (attackers(row["variant"], clients), float(row["mean"]), half, int(row["n"]))
            lines.setdefault((topology, row["defense"]), []).append(point)
    return {key: sorted(points) for key, points in lines.items()}


def plot(
    rows: dict[tuple[str, str], list[tuple[int, float, float, int]]], out: Path, clients: int
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = [t for t in DEFAULT_ORDER if any(key[0] == t for key in rows)]
    topologies += sorted({t for t, _ in rows} - set(topologies))
    defenses = [d for d in DEFENSE_ORDER if any(key[1] == d for key in rows)]
    defenses += sorted({d for _, d in rows} - set(defenses))
    seeds = sorted({n for points in rows.values() for *_, n in points})
    figure, axes = plt.subplots(
        1, len(topologies), figsize=(3.2 * len(topologies), 3.4), sharey=True
    )
    axes = list(axes) if len(topologies) > 1 else [axes]
    for panel, topology in zip(axes, topologies):
        for offset, defense in enumerate(defenses):
            points = rows.get((topology, defense), [])
            if not points:
                continue
            shift = (offset - (len(defenses) - 1) / 2) * 0.08  # keep overlapping bars readable
            panel.errorbar(
                [p[0] + shift for p in points],
                [p[1] for p in points],
                yerr=[p[2] for p in points],
                marker="o",
                capsize=3,
                label=defense,
            )
        panel.set_title(topology)
        panel.set_xlabel(f"attackers of {clients}")
        panel.set_xticks(sorted({p[0] for points in rows.values() for p in points}))
        panel.set_ylim(0, 1)
        panel.grid(alpha=0.3)
    axes[0].set_ylabel("honest final accuracy (mean)")
    axes[-1].legend(title="defense", fontsize=8, loc="lower left")
    figure.suptitle(
        f"DP-DSGD (epsilon 8) under dissensus: mean over {'/'.join(map(str, seeds))} seeds, 95% t intervals",
        fontsize=10,
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path, help="p4bench compare --format csv output")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--clients", type=int, default=16, help="clients of the study's runs")
    args = parser.parse_args()
    print(plot(read_rows(args.table, args.clients), args.out, args.clients))


if __name__ == "__main__":
    main()
