"""The `pdsl` preset of `p4bench reproduce`: Wang, Yuan, Wang and Li, "Privacy-Preserved
Decentralized Stochastic Learning" (`shared/reference/seed-004-pdsl.md`, sections 4-5):
Table I's grid (MNIST) as rankings, recommendations 5 and 8.

The grid (`pdsl_variants`): every cell epsilon x topology x M of Table I, methods `pdsl`,
`dp-cga`, `muffliato` and `dp-dsgd` with `order=d-psgd` (the paper's DP-DPSGD; DP-NET-FLEET
is not in the suite: its figures are printed, never compared). Topology is each method's
option `topology` (complete, bipartite: complete bipartite M/2 x M/2, ring; Metropolis-
Hastings weights with self-loops for all four); M = `clients` in {10, 20}, every client a
node of the graph (20% of them are the suite's evaluation clients, used for lr tuning and
never reported). Beside the grid, per M: centralized training on the agents' pooled
records, non-private, the ceiling (`CEILING`), a reference row that no claim uses.

Data: digits (offline) stands in for MNIST: label skew by the `dirichlet` partitioner at
`dirichlet_alpha` = 0.25, the paper's mu: each agent's class proportions ~ Dir(mu 1_10)
(Hsu et al.; the paper does not say whether it draws per agent or per class), 100 records
an agent at M = 10 and 50 at M = 20 (the paper: 60,000 / M, so halved too; the same counts
for every method, although PDSL's shared validation set Q is held out first), the suite's
linear model (the paper's small CNN would cost the budget below; `--set model=cnn`).

Privacy: the paper's epsilon (0.08, 0.1, 0.3 on MNIST) is PER ROUND (Theorem 1, no
composition, and its bound is infinite as written, spec 1.4); the suite certifies epsilon
for the whole run. We run at certified epsilon 1, 3 and 8 (`EPSILONS`: the range where
accuracy is neither noise nor saturated) and pair them by rank with the paper's values
(`PAPER_EPSILONS`), printed beside as reference only. Every run is private under one
relation (add-remove) and one target epsilon per cell, certified (the suite's equal-privacy
rule). All four methods use the same mechanism: per-example clipping to C, Poisson sampling
at the run's data rate, Gaussian noise, the same accountant; `pdsl` and `dp-cga` therefore
run with `clip_mode=per-example` (one release of the |M_i| cross-gradients a round). The
paper's batch clipping (sensitivity 2C, no amplification) is the plugins' default, but at
an equal certified epsilon it needs about four times the noise multiplier and left 2-30%
accuracy in our probes (40 rounds, epsilon 3), so the tables would only rank noise.

Rounds: one gradient step per round for every method (`iterations=1` for dp-dsgd and
muffliato, whose round is otherwise K = 5 steps), as the paper's x-axis; dp-dsgd gossips
once after it, muffliato `MUFFLIATO_GOSSIP` = 5 times with Chebyshev acceleration (its own
multi-step gossip; its paper ties the count to the graph's spectral gap, a choice made once
here: `--set options.gossip_steps=K` changes it); accuracy on the global test set (the
paper's test accuracy of a consensus model), each agent's own split beside; `ROUNDS` = 80
(the paper: ~180-200), R = 10 Shapley permutations, PDSL's momentum 0.5 (MNIST's). lr is
tuned per method at epsilon 3, complete, M = 10, on
`TUNE_GRID`, and used in every cell. PDSL runs with `normalize_pi=true` (weights = the
Shapley shares, summing to 1): pi as written sums to |M_i| (spec 1.2, [FLAG]), so one lr
gives a step |M_i| times lr, 20x on the complete graph at M = 20 and 3x on a ring, and the
claims would compare step sizes, not graphs. As written (the plugin's default, `p4bench
run -o normalize_pi=false`) a full run at 40 rounds gave PDSL first in 5 of 18 cells and the
topology order in 0 of 6 (its best graph at M = 20 the ring, its worst the complete graph).

Cost (2 cores shared with other jobs, `-j 2`): 216 runs (3 seeds) and 20 tuning runs in 11 minutes,
most of it PDSL and DP-CGA on the complete and bipartite graphs at M = 20 (|M_i|
cross-gradients and R |M_i| Shapley evaluations per agent and round); a quick run (3
rounds, epsilon 3, M = 10, one seed: 12 runs and 8 tuning runs, and the ceiling's) in 30 s (about a minute
on a loaded machine).

Claims (`pdsl_claims`), recommendation 8: (1) PDSL has the best accuracy in every cell
(strictly above every other method run there), one verdict per cell and overall; (2) for
PDSL, complete >= bipartite > ring at every epsilon x M. Each cell's verdict rests on the
paired differences over seeds (PDSL minus each rival; complete minus bipartite at or above
0, bipartite minus ring above 0) with a 95% t interval: yes, no or inconclusive, and a
claim is yes only if every cell is. `presets_pdsl_report` prints the per-cell verdicts,
Table I beside ours and draws the plot, naming the dataset that ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from p4bench.studies.claims import Cell as Paired
from p4bench.studies.claims import (
    ClaimCheck,
    ClaimContext,
    from_cells,
    joined,
    not_checked,
    pct,
    seed_runs,
    without_references,
)
from p4bench.studies.claims import cell as paired_cell
from p4bench.studies.presets import NON_PRIVATE
from p4bench.studies.sweep_plan import REFERENCE

__all__ = [
    "CEILING",
    "CLIENTS",
    "EPSILONS",
    "GROUP_BY",
    "METHODS",
    "MUFFLIATO_GOSSIP",
    "PAPER_EPSILONS",
    "PAPER_Q",
    "PAPER_NAMES",
    "QUICK_CLIENTS",
    "QUICK_EPSILONS",
    "ROUNDS",
    "SAMPLES",
    "TABLE_I",
    "TOPOLOGIES",
    "TOPOLOGY",
    "TUNE_AT",
    "TUNE_GRID",
    "cell_means",
    "cell_seeds",
    "cell_verdicts",
    "paper_epsilon",
    "pdsl_claims",
    "pdsl_first_claim",
    "pdsl_per_method",
    "pdsl_settings",
    "pdsl_variants",
    "topology_claim",
    "topology_verdicts",
]

METHODS = ("pdsl", "dp-cga", "muffliato", "dp-dsgd")
TOPOLOGIES = ("complete", "bipartite", "ring")  # the claim's order: FC >= bipartite > ring
CLIENTS = (10, 20)
EPSILONS = (1.0, 3.0, 8.0)  # certified over the whole run
PAPER_EPSILONS = (0.08, 0.1, 0.3)  # Table I's, per round: paired with EPSILONS by rank
QUICK_EPSILONS, QUICK_CLIENTS = (3.0,), (10,)
SAMPLES = {10: 100, 20: 50}  # records an agent (train + test); the paper's 60,000 / M, scaled
ROUNDS = 80
MU = 0.25  # the paper's Dirichlet concentration
CEILING = "non-private pooled ceiling"  # centralized's `reference` (`sweep_plan.REFERENCE`)
TOPOLOGY = "options.topology"
GROUP_BY = ("epsilon", TOPOLOGY, "clients", "method")
TUNE_AT = {"epsilon": 3.0, TOPOLOGY: "complete", "clients": 10}
TUNE_GRID = (
    0.03,
    0.1,
    0.3,
    1.0,
    3.0,
    10.0,
    30.0,
)  # lr candidates: wide enough that the best is inside it
MUFFLIATO_GOSSIP = (
    5  # gossip steps per noisy step (the paper ties K to the spectral gap; one K for every graph)
)
PAPER_Q = 2000  # PDSL's validation set Q on MNIST
PAPER_NAMES = {
    "pdsl": "PDSL",
    "dp-cga": "DP-CGA",
    "muffliato": "MUFFLIATO",
    "dp-dsgd": "DP-DPSGD",
    "dp-net-fleet": "DP-NET-FLEET",
}

# Table I (MNIST, test accuracy), REFERENCE ONLY, NOT COMPARABLE with ours (another dataset,
# model and privacy definition). Keyed (paper's per-round epsilon, method, topology, M);
# dp-net-fleet is not in the suite.
_COLUMNS = tuple((t, m) for t in TOPOLOGIES for m in CLIENTS)
_ROWS = {
    0.08: {
        "dp-dsgd": (0.853, 0.668, 0.822, 0.655, 0.817, 0.604),
        "dp-cga": (0.881, 0.817, 0.865, 0.779, 0.857, 0.715),
        "muffliato": (0.838, 0.788, 0.833, 0.782, 0.825, 0.762),
        "dp-net-fleet": (0.912, 0.902, 0.892, 0.872, 0.872, 0.842),
        "pdsl": (0.938, 0.932, 0.925, 0.917, 0.884, 0.849),
    },
    0.1: {
        "dp-dsgd": (0.865, 0.705, 0.838, 0.675, 0.833, 0.642),
        "dp-cga": (0.902, 0.851, 0.887, 0.813, 0.881, 0.769),
        "muffliato": (0.887, 0.846, 0.885, 0.841, 0.887, 0.835),
        "dp-net-fleet": (0.925, 0.914, 0.906, 0.887, 0.893, 0.858),
        "pdsl": (0.957, 0.955, 0.946, 0.943, 0.913, 0.871),
    },
    0.3: {
        "dp-dsgd": (0.875, 0.723, 0.851, 0.693, 0.847, 0.653),
        "dp-cga": (0.915, 0.866, 0.904, 0.852, 0.898, 0.793),
        "muffliato": (0.906, 0.857, 0.899, 0.848, 0.892, 0.841),
        "dp-net-fleet": (0.938, 0.922, 0.927, 0.903, 0.912, 0.875),
        "pdsl": (0.965, 0.962, 0.965, 0.961, 0.936, 0.892),
    },
}
TABLE_I: dict[tuple[float, str, str, int], float] = {
    (eps, method, topology, m): value
    for eps, rows in _ROWS.items()
    for method, values in rows.items()
    for (topology, m), value in zip(_COLUMNS, values)
}

Cell = tuple[float, str, int]  # (epsilon, topology, M)
Seeds = dict[Cell, dict[str, dict[str, float]]]  # cell -> method -> seed -> accuracy


def paper_epsilon(epsilon: float) -> float | None:
    """The paper's per-round epsilon paired (by rank) with our certified one; None if unpaired."""
    pairs = dict(zip(EPSILONS, PAPER_EPSILONS))
    return next((p for e, p in pairs.items() if math.isclose(e, epsilon)), None)


# -- the runs -----------------------------------------------------------------------------------


def pdsl_settings(dataset: str, quick: bool) -> dict[str, Any]:
    """Label skew at mu = 0.25, the linear model, one private relation, the scale."""
    return {
        "partitioner": "dirichlet",
        "options.dirichlet_alpha": MU,
        "model": "linear",
        "malicious_fraction": 0.0,
        "rounds": 3 if quick else ROUNDS,
    }


def pdsl_per_method(quick: bool) -> dict[str, dict[str, Any]]:
    """One gradient step per round for each method, one mechanism (per-example clipping)."""
    return {
        "pdsl": {
            "options.clip_mode": "per-example",
            "options.momentum": 0.5,
            "options.R": 10,
            "options.normalize_pi": True,
        },
        "dp-cga": {"options.clip_mode": "per-example"},
        # Muffliato's own multi-step gossip after its one noisy step (Chebyshev-accelerated, as its
        # paper); with one plain gossip step it would be adapt-then-combine DSGD, i.e. DP-DPSGD again
        "muffliato": {
            "options.iterations": 1,
            "options.gossip_steps": MUFFLIATO_GOSSIP,
            "options.chebyshev": True,
        },
        "dp-dsgd": {"options.iterations": 1, "options.order": "d-psgd"},
    }


def pdsl_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    """One block per M (the records an agent depend on M): methods x epsilon x topology;
    then per M the non-private centralized ceiling (`CEILING`: the agents' pooled records,
    no graph), a reference row that no claim uses."""
    blocks = [
        {"label": f"M={m}", "clients": m, "samples_per_client": SAMPLES[m], "attack": "none"}
        for m in (QUICK_CLIENTS if quick else CLIENTS)
    ]
    grid = {
        "method": list(METHODS),
        "epsilon": list(QUICK_EPSILONS if quick else EPSILONS),
        TOPOLOGY: list(TOPOLOGIES),
    }
    ceiling = {"method": "centralized", **NON_PRIVATE, REFERENCE: CEILING}
    return [{**b, **grid} for b in blocks] + [{**b, **ceiling} for b in blocks]


# -- cells from the table -----------------------------------------------------------------------


def _text(value: Any) -> str:
    """A table cell as plain text: plugin options are logged JSON-encoded ('"ring"')."""
    text = str(value)
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def cell_means(table: Any) -> dict[Cell, dict[str, float]]:
    """{(epsilon, topology, M): {method: mean accuracy over seeds}} of the table's rows."""
    cells: dict[Cell, dict[str, float]] = {}
    if table is None or not len(table):
        return cells
    for row in without_references(table).to_dict("records"):  # the ceiling is in no cell
        key = (float(row["epsilon"]), _text(row[TOPOLOGY]), int(float(row["clients"])))
        cells.setdefault(key, {})[str(row["method"])] = float(row["mean"])
    return cells


def cell_seeds(table: Any, ctx: ClaimContext | None = None) -> Seeds:
    """{(epsilon, topology, M): {method: {seed: accuracy}}} of the runs behind the table
    (`ClaimContext.runs`; without them the table's means, one pseudo-seed)."""
    cells: Seeds = {}
    if table is None or not len(table):
        return cells
    for row in seed_runs(table, ctx).to_dict("records"):
        key = (float(row["epsilon"]), _text(row[TOPOLOGY]), int(float(row["clients"])))
        by_method = cells.setdefault(key, {}).setdefault(str(row["method"]), {})
        by_method[str(row["seed"])] = float(row["value"])
    return cells


def _cell_name(cell: Cell) -> str:
    return f"eps {cell[0]:g} / {cell[1]} / M={cell[2]}"


def _mean(values: Mapping[str, float]) -> float:
    return sum(values.values()) / len(values) if values else math.nan


def cell_verdicts(cells: Seeds) -> dict[Cell, tuple[Paired, str]]:
    """Claim (1) per cell with PDSL and a rival: (PDSL minus every rival, paired by seed,
    joined: the closest rival's interval; the cell's ranking by mean over seeds)."""
    out = {}
    for cell in sorted(cells):
        scores = {m: v for m, v in cells[cell].items() if v}
        rivals = [m for m in scores if m != "pdsl"]
        if "pdsl" not in scores or not rivals:
            continue
        ranking = ", ".join(
            f"{m} {pct(_mean(v))}" for m, v in sorted(scores.items(), key=lambda kv: -_mean(kv[1]))
        )
        pairs = [paired_cell(f"pdsl - {m}", scores["pdsl"], scores[m]) for m in rivals]
        out[cell] = (joined(_cell_name(cell), pairs), ranking)
    return out


def pdsl_first_claim(cells: Seeds, skipped: tuple[str, ...] = ()) -> ClaimCheck:
    """(1) PDSL first in every cell (epsilon x topology x M): above every rival, paired by seed."""
    claim = (
        "PDSL has the best accuracy in every cell (epsilon x topology x M), above DP-CGA, MUFFLIATO and "
        'DP-DPSGD (the paper, Table I, MNIST: "PDSL significantly outperforms the other reference '
        'algorithms"; Table II, CIFAR-10: "PDSL performs better in test accuracy")'
    )
    verdicts = cell_verdicts(cells)
    if not verdicts:
        return not_checked(
            claim,
            "needs PDSL and another method in one cell"
            + (f" ({', '.join(skipped)} not registered)" if skipped else ""),
        )
    return from_cells(claim, [found for found, _ in verdicts.values()])


def topology_verdicts(cells: Seeds) -> dict[tuple[float, int], tuple[Paired, str]]:
    """Claim (2) per (epsilon, M) with PDSL on all three graphs: (complete - bipartite at or
    above 0 and bipartite - ring above 0, paired by seed and joined; the means)."""
    out = {}
    for eps, m in sorted({(c[0], c[2]) for c in cells}):
        pdsl = {t: cells.get((eps, t, m), {}).get("pdsl", {}) for t in TOPOLOGIES}
        if not all(pdsl.values()):
            continue
        pairs = [
            paired_cell(
                "complete - bipartite", pdsl["complete"], pdsl["bipartite"], 0.0, "at-or-above"
            ),
            paired_cell("bipartite - ring", pdsl["bipartite"], pdsl["ring"]),
        ]
        figures = ", ".join(f"{t} {pct(_mean(v))}" for t, v in pdsl.items())
        out[(eps, m)] = (joined(f"eps {eps:g} M={m}", pairs), figures)
    return out


def topology_claim(cells: Seeds) -> ClaimCheck:
    """(2) for PDSL, fully connected >= bipartite > ring at every epsilon x M."""
    claim = (
        "PDSL: fully connected >= bipartite > ring at every epsilon x M (read from the paper's Tables "
        'I-II, MNIST and CIFAR-10, which state no ordering in words; spec recommendation 8: "For PDSL, '
        'FC >= bipartite > ring")'
    )
    verdicts = topology_verdicts(cells)
    if not verdicts:
        return not_checked(
            claim, "needs PDSL on the complete, bipartite and ring graphs at one epsilon and M"
        )
    return from_cells(claim, [found for found, _ in verdicts.values()])


def pdsl_claims(table: Any, ctx: ClaimContext) -> list[ClaimCheck]:
    """Keys `GROUP_BY`: claims (1) and (2) of recommendation 8, paired by seed."""
    cells = cell_seeds(table, ctx)
    return [pdsl_first_claim(cells, ctx.skipped), topology_claim(cells)]
