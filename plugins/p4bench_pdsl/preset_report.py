"""The `pdsl` preset's report (`p4bench_pdsl.preset`): the verdict of claims (1) and (2)
per cell with its paired difference and 95% interval (a quick run prints "not tested" with
the figures), Table I of the paper beside ours as reference values only (another dataset,
model and privacy definition: the paper's epsilon is per round, ours certified over the
run), and a plot of each method's accuracy per cell: one panel per epsilon x M, the three
topologies on the x-axis. Every line names the dataset that ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from p4bench.studies.claims import Cell as Paired
from p4bench.studies.claims import ClaimContext, pct
from p4bench.studies.presets import Preset
from p4bench_pdsl.preset import (
    CLIENTS,
    GROUP_BY,
    METHODS,
    PAPER_NAMES,
    PAPER_Q,
    TABLE_I,
    TOPOLOGIES,
    TUNE_AT,
    TUNE_GRID,
    Cell,
    Seeds,
    cell_means,
    cell_seeds,
    cell_verdicts,
    paper_epsilon,
    pdsl_claims,
    pdsl_per_method,
    pdsl_settings,
    pdsl_variants,
    topology_verdicts,
)

__all__ = ["PDSL_PRESET", "pdsl_report", "plot_cells", "table_i_lines", "verdict_lines"]

SHORT = {"complete": "FC", "bipartite": "Bip", "ring": "Ring"}


def _status(found: Paired, quick: bool) -> str:
    return "not tested" if quick else found.status


def verdict_lines(cells: Seeds, quick: bool) -> list[str]:
    """Claim (1) per cell and claim (2) per (epsilon, M), one line each: the verdict, the
    figures and the deciding paired difference with its 95% interval."""
    lines = [
        "claim (1) per cell, PDSL first (methods ranked by mean accuracy over seeds; the verdict from "
        "PDSL minus each rival, paired by seed, 95% t interval)"
        + (": quick smoke run, not tested" if quick else "")
    ]
    first = cell_verdicts(cells)
    lines += [
        f"  eps {e:g} / {t} / M={m}: {_status(found, quick)} ({ranking}; "
        f"{found.name.split(': ', 1)[1]} {found.interval.text()})"
        for (e, t, m), (found, ranking) in first.items()
    ]
    if not first:
        lines.append("  no cell with PDSL and another method")
    lines.append(
        "claim (2) per epsilon x M, PDSL: complete >= bipartite > ring"
        + (": not tested" if quick else "")
    )
    order = topology_verdicts(cells)
    lines += [
        f"  eps {e:g} / M={m}: {_status(found, quick)} ({figures}; "
        f"{found.name.split(': ', 1)[1]} {found.interval.text()})"
        for (e, m), (found, figures) in order.items()
    ]
    if not order:
        lines.append("  no (epsilon, M) with PDSL on all three topologies")
    return lines


def table_i_lines(cells: Mapping[Cell, Mapping[str, float]], dataset: str = "digits") -> list[str]:
    """Table I's accuracies beside ours (on `dataset`), per epsilon of ours paired with the
    paper's."""
    lines = [
        f"Table I of the paper (MNIST, CNN, epsilon PER ROUND) beside ours ({dataset}, linear model, epsilon "
        "certified over the whole run): REFERENCE ONLY, NOT COMPARABLE, no verdict; each entry ours / paper"
    ]
    header = "".join(f"{SHORT[t] + ' M' + str(m):>15}" for t in TOPOLOGIES for m in CLIENTS)
    for eps in sorted({c[0] for c in cells}):
        paper = paper_epsilon(eps)
        lines.append(
            f"  ours eps {eps:g} <-> paper eps {paper:g}/round"
            if paper is not None
            else f"  ours eps {eps:g} (no paper value paired)"
        )
        lines.append(f"    {'':<13}{header}")
        for method in (*METHODS, "dp-net-fleet"):
            entries = []
            for topology in TOPOLOGIES:
                for m in CLIENTS:
                    ours = cells.get((eps, topology, m), {}).get(method, math.nan)
                    ref = (
                        TABLE_I.get((paper, method, topology, m), math.nan)
                        if paper is not None
                        else math.nan
                    )
                    entries.append(f"{pct(ours).rstrip('%'):>6} / {pct(ref).rstrip('%'):>5}")
            note = "  (not in the suite)" if method == "dp-net-fleet" else ""
            lines.append(
                f"    {PAPER_NAMES[method]:<13}{''.join(f'{e:>15}' for e in entries)}{note}"
            )
    if not cells:
        lines.append("  no run finished")
    return lines


def plot_cells(cells: Mapping[Cell, Mapping[str, float]], path: Path, title: str) -> Path | None:
    """Bars of each method's accuracy: one panel per (epsilon, M), topologies on the x-axis;
    None without any cell."""
    if not cells:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epsilons = sorted({c[0] for c in cells})
    clients = sorted({c[2] for c in cells})
    methods = [m for m in METHODS if any(m in v for v in cells.values())]
    methods += sorted({m for v in cells.values() for m in v} - set(methods))
    fig, axes = plt.subplots(
        len(epsilons),
        len(clients),
        figsize=(4.2 * len(clients), 3.0 * len(epsilons)),
        dpi=100,
        squeeze=False,
        sharey=True,
    )
    width = 0.8 / max(1, len(methods))
    for row, eps in enumerate(epsilons):
        for col, m in enumerate(clients):
            ax = axes[row][col]
            for k, method in enumerate(methods):
                values = [cells.get((eps, t, m), {}).get(method, math.nan) for t in TOPOLOGIES]
                ax.bar(
                    [i + (k - (len(methods) - 1) / 2) * width for i in range(len(TOPOLOGIES))],
                    values,
                    width,
                    color=f"C{k}",
                    label=method,
                )
            ax.set_xticks(range(len(TOPOLOGIES)), list(TOPOLOGIES), fontsize=8)
            ax.set_ylim(0, 1)
            ax.grid(axis="y", alpha=0.3)
            ax.set_title(f"epsilon {eps:g} (certified), M = {m}", fontsize=9)
        axes[row][0].set_ylabel("mean final accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def q_line(dataset: str) -> str:
    """How large PDSL's Q is on `dataset` against the paper's 2,000, said where it is smaller:
    the public pool's share of the records left after the global test set."""
    from p4bench.config import RunConfig
    from p4bench.data.base import load_dataset
    from p4bench.data.paths import data_dir
    from p4bench.data.public import PUBLIC_DATA_OPTIONS
    from p4bench.errors import P4BenchError
    from p4bench.host.manager import default_registry

    try:
        loaded = load_dataset(
            default_registry().get("dataset", dataset), data_dir(), RunConfig(dataset=dataset)
        )
    except (P4BenchError, OSError) as exc:
        return f"Q: not computed ({exc})"
    share = next(o.default for o in PUBLIC_DATA_OPTIONS if o.name == "public_pool")
    left = (
        len(loaded.y_train) if len(loaded.y_test) else round(0.8 * len(loaded.y_train))
    )  # after the global test set
    size = min(PAPER_Q, round(float(share) * left))
    note = (
        "the paper's size"
        if size >= PAPER_Q
        else f"SMALLER than the paper's {PAPER_Q:,}: {dataset} has too few records"
    )
    return (
        f"Q, PDSL's shared validation set: {size:,} labeled records held out of {dataset} ({note})"
    )


def pdsl_report(table: Any, ctx: ClaimContext, folder: Path, experiment: str) -> list[str]:
    """Lines printed after the table: per-cell verdicts, Table I beside ours, the plot."""
    cells = cell_means(table)
    lines = verdict_lines(cell_seeds(table, ctx), ctx.quick)
    lines += table_i_lines(cells, ctx.dataset) + [q_line(ctx.dataset)]
    plot = plot_cells(
        cells,
        folder / f"{experiment}-accuracy-by-cell.png",
        f"{experiment}: accuracy per method, topology, epsilon and M ({ctx.dataset}, Dirichlet mu 0.25)",
    )
    lines.append(
        f"plot of accuracy per cell: {plot}"
        if plot
        else "plot of accuracy per cell: no run finished"
    )
    return lines


PDSL_PRESET = Preset(
    "pdsl",
    "Wang et al. (PDSL): Table I's grid, epsilon x topology (complete/bipartite/ring) x M (10/20), PDSL vs "
    "DP-CGA, Muffliato, DP-DPSGD at one certified epsilon; digits at Dirichlet mu 0.25 stands in for MNIST",
    ("digits", "mnist"),
    {},
    pdsl_variants,
    GROUP_BY,
    pdsl_claims,
    settings=pdsl_settings,
    per_method_for=pdsl_per_method,
    tune_at=TUNE_AT,
    tune_grid=TUNE_GRID,
    report=pdsl_report,
    baselines="every method is private (per-example clipping, Poisson sampling, one accountant) at the "
    "cell's certified epsilon over the whole run; the paper's epsilon is per round (reference only); "
    "centralized is the non-private pooled ceiling per M, a reference row no claim uses",
    eval_set="global",
)
