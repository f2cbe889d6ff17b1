"""`p4bench reproduce pdsl`: the preset is registered, its grid holds Table I's factors at
one relation and certified epsilon per cell, the two claims pass and fail on known tables,
Table I is printed as reference values only, and a quick smoke run on digits prints the
verdicts ("not tested") and writes the plot."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from p4bench.cli import main
from p4bench.host.manager import default_registry
from p4bench.studies.claims import ClaimContext
from p4bench.studies.equal_privacy import from_config
from p4bench.studies.presets import PRESETS, describe_presets
from p4bench.studies.reproduce import plan_preset, quick_claims
from p4bench_pdsl.preset import (
    CLIENTS,
    EPSILONS,
    GROUP_BY,
    METHODS,
    SAMPLES,
    TABLE_I,
    TOPOLOGIES,
    cell_means,
    cell_seeds,
    paper_epsilon,
    pdsl_claims,
    pdsl_first_claim,
    topology_claim,
)
from p4bench_pdsl.preset_report import pdsl_report

CTX = ClaimContext("digits", False, ())
NEEDED = (
    *(("method", m) for m in METHODS),
    ("partitioner", "dirichlet"),
    *(("topology", t) for t in TOPOLOGIES),
)
missing = [
    f"{kind} '{name}'" for kind, name in NEEDED if name not in default_registry().names(kind)
]
needs_plugins = pytest.mark.skipif(
    bool(missing), reason=f"pdsl preset plugins not registered: {', '.join(missing)}"
)
# PDSL best everywhere, complete > bipartite > ring; the rivals' order does not matter
GOOD = {
    "pdsl": {"complete": 0.90, "bipartite": 0.88, "ring": 0.80},
    "dp-cga": {"complete": 0.85, "bipartite": 0.84, "ring": 0.78},
    "muffliato": {"complete": 0.70, "bipartite": 0.72, "ring": 0.75},
    "dp-dsgd": {"complete": 0.60, "bipartite": 0.60, "ring": 0.60},
}


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


def table(scores=GOOD, epsilons=EPSILONS, clients=CLIENTS, change=None):
    """The aggregated table as `compare` gives it: key values as text, options JSON-encoded."""
    rows = []
    for eps in epsilons:
        for m in clients:
            for method, by_topology in scores.items():
                for topology, value in by_topology.items():
                    value = (change or {}).get((eps, topology, m, method), value)
                    rows.append(
                        {
                            **dict(zip(GROUP_BY, (str(eps), f'"{topology}"', str(m), method))),
                            "mean": value,
                            "std": 0.0,
                            "n": 3,
                        }
                    )
    return pd.DataFrame(rows)


def seeded(frame, quick=False, offsets=(-0.01, 0.0, 0.01)):
    """The claims' context with each row of `frame` run on three seeds shifting every row
    alike (the paired differences agree across seeds)."""
    runs = pd.DataFrame(
        [
            {**{k: row[k] for k in GROUP_BY}, "seed": str(s), "value": row["mean"] + o}
            for row in frame.to_dict("records")
            for s, o in enumerate(offsets)
        ]
    )
    return ClaimContext("digits", quick, (), runs)


def seeds(frame):
    return cell_seeds(frame, seeded(frame))


# -- registration and plans ---------------------------------------------------------------------------


def test_registered_and_listed():
    preset = PRESETS["pdsl"]
    assert (
        preset.report is not None
        and preset.group_by == GROUP_BY
        and preset.neighbouring == "add-remove"
    )
    name, datasets, summary = next(d for d in describe_presets() if d[0] == "pdsl")
    assert datasets == "digits, mnist" and "MNIST" in summary and "Dirichlet mu 0.25" in summary


@needs_plugins
def test_full_grid_holds_table_i_factors_at_equal_privacy(no_data):
    plan = plan_preset("pdsl")
    assert (
        plan.dataset == "digits" and not plan.skipped and plan.spec.name == "reproduce-pdsl-digits"
    )
    configs = [r.config for r in plan.runs if "reference" not in r.tags]  # the ceiling apart
    ceiling = [r.config for r in plan.runs if "reference" in r.tags]
    assert Counter((c.method, c.clients, c.epsilon) for c in ceiling) == {
        ("centralized", m, None): 3 for m in CLIENTS
    }
    cells = Counter((c.epsilon, c.options["topology"], c.clients, c.method) for c in configs)
    assert cells == {
        (e, t, m, method): 3
        for e in EPSILONS
        for t in TOPOLOGIES
        for m in CLIENTS
        for method in METHODS
    }
    assert all(
        from_config(c).private and c.neighbouring == "add-remove" for c in configs
    )  # one relation, all private
    assert all(
        c.partitioner == "dirichlet" and c.options["dirichlet_alpha"] == 0.25 for c in configs
    )
    assert all(
        c.samples_per_client == SAMPLES[c.clients] and c.rounds == 80 and c.attack is None
        for c in configs
    )
    by_method = {c.method: c.options for c in configs}
    assert (
        by_method["pdsl"]["clip_mode"] == by_method["dp-cga"]["clip_mode"] == "per-example"
    )  # one mechanism
    assert by_method["dp-dsgd"]["order"] == "d-psgd" and by_method["dp-dsgd"]["iterations"] == 1
    assert by_method["muffliato"]["iterations"] == 1 and by_method["pdsl"]["momentum"] == 0.5


@needs_plugins
def test_quick_grid_shrinks(no_data):
    plan = plan_preset("pdsl", quick=True)
    configs = [r.config for r in plan.runs if "reference" not in r.tags]  # the ceiling apart
    assert len(configs) == len(METHODS) * len(TOPOLOGIES) and {c.seed for c in configs} == {0}
    assert len(plan.runs) == len(configs) + 1
    assert (
        {c.epsilon for c in configs} == {3.0}
        and {c.clients for c in configs} == {10}
        and {c.rounds for c in configs} == {3}
    )


def test_table_i_reference_values():
    assert len(TABLE_I) == 3 * 5 * 6  # epsilon x method (DP-NET-FLEET too) x topology x M
    assert (
        TABLE_I[(0.08, "pdsl", "complete", 10)] == 0.938
        and TABLE_I[(0.3, "dp-dsgd", "ring", 20)] == 0.653
    )
    assert (
        TABLE_I[(0.1, "muffliato", "bipartite", 20)] == 0.841
        and TABLE_I[(0.3, "dp-net-fleet", "ring", 10)] == 0.912
    )
    assert [paper_epsilon(e) for e in EPSILONS] == [0.08, 0.1, 0.3] and paper_epsilon(2.0) is None


# -- claims on known tables -----------------------------------------------------------------------------


def test_pdsl_first_passes_and_fails_per_cell():
    cells = cell_means(table())
    assert len(cells) == 18 and cells[(3.0, "ring", 20)]["pdsl"] == 0.80
    check = pdsl_first_claim(seeds(table()))
    assert check.status == "yes" and "18 yes, 0 no, 0 inconclusive of 18" in check.detail
    lost = table(
        change={(1.0, "ring", 20, "dp-cga"): 0.81, (8.0, "complete", 10, "muffliato"): 0.90}
    )
    check = pdsl_first_claim(seeds(lost))
    assert check.status == "no" and "16 yes, 2 no, 0 inconclusive of 18" in check.detail
    assert "eps 1 / ring / M=20: pdsl - dp-cga -1.0 points [95% CI -1.0, -1.0], n=3: no" in (
        check.detail
    )
    assert "eps 8 / complete / M=10: pdsl - muffliato +0.0 points" in check.detail  # a tie: no
    assert pdsl_first_claim(seeds(table({"pdsl": GOOD["pdsl"]}))).status == "not checked"
    # seeds that disagree: PDSL ahead of DP-CGA by +5 points on average, but not on every seed
    noisy = seeded(table(), offsets=(0.0, 0.0, 0.0))
    noisy.runs.loc[(noisy.runs["method"] == "pdsl") & (noisy.runs["seed"] == "1"), "value"] -= 0.2
    check = pdsl_first_claim(cell_seeds(table(), noisy))
    assert check.status == "inconclusive" and "a decisive verdict needs about" in check.detail


def test_topology_order_passes_and_fails():
    assert topology_claim(seeds(table())).status == "yes"
    tie = table(change={(3.0, "bipartite", 10, "pdsl"): 0.90})  # complete == bipartite: in order
    assert topology_claim(seeds(tie)).status == "yes"
    flat = table(change={(3.0, "ring", 10, "pdsl"): 0.88})  # bipartite == ring: not strictly above
    check = topology_claim(seeds(flat))
    assert check.status == "no" and "5 yes, 1 no, 0 inconclusive of 6" in check.detail
    assert "eps 3 M=10: bipartite - ring +0.0 points [95% CI +0.0, +0.0], n=3: no" in check.detail
    swapped = table(change={(8.0, "complete", 20, "pdsl"): 0.85})  # bipartite above complete
    assert topology_claim(seeds(swapped)).status == "no"
    no_ring = table()
    no_ring = no_ring[no_ring[GROUP_BY[1]] != '"ring"']
    assert topology_claim(seeds(no_ring)).status == "not checked"
    assert [c.status for c in pdsl_claims(flat, seeded(flat))] == ["yes", "no"]
    assert [c.status for c in quick_claims(pdsl_claims(flat, seeded(flat)))] == [
        "not tested",
        "not tested",
    ]
    # a table alone (no runs): one pseudo-seed, no interval, no verdict
    assert [c.status for c in pdsl_claims(flat, CTX)] == ["inconclusive", "inconclusive"]


def test_report_verdicts_reference_values_and_plot(tmp_path):
    changed = table(change={(1.0, "ring", 20, "dp-cga"): 0.81})
    lines = pdsl_report(changed, replace(seeded(changed), dataset="mnist"), tmp_path, "x")
    assert (
        "  eps 1 / ring / M=20: no (dp-cga 81.0%, pdsl 80.0%, muffliato 75.0%, dp-dsgd 60.0%; "
        "pdsl - dp-cga -1.0 points [95% CI -1.0, -1.0], n=3)"
    ) in lines
    assert (
        "  eps 8 / M=20: yes (complete 90.0%, bipartite 88.0%, ring 80.0%; complete - bipartite "
        "+2.0 points [95% CI +2.0, +2.0], n=3)"
    ) in lines
    assert any("REFERENCE ONLY, NOT COMPARABLE" in line for line in lines)
    assert any("beside ours (mnist, linear model" in line for line in lines)  # the dataset that ran
    assert not any("digits" in line for line in lines)
    assert "  ours eps 1 <-> paper eps 0.08/round" in lines
    pdsl_row = next(line for line in lines if line.strip().startswith("PDSL") and "93.8" in line)
    assert pdsl_row.split()[1:4] == ["90.0", "/", "93.8"]  # FC M10 at eps 1 vs the paper's 0.08
    assert any("DP-NET-FLEET" in line and "(not in the suite)" in line for line in lines)
    plot = tmp_path / "x-accuracy-by-cell.png"
    assert lines[-1] == f"plot of accuracy per cell: {plot}" and plot.stat().st_size > 0
    quick = pdsl_report(table(), ClaimContext("digits", True, ()), tmp_path, "y")
    assert (
        "  eps 3 / complete / M=10: not tested (pdsl 90.0%, dp-cga 85.0%, muffliato 70.0%, dp-dsgd 60.0%; "
        "pdsl - dp-cga +5.0 points (n=1: no interval))"
    ) in quick
    assert pdsl_report(None, CTX, tmp_path, "z")[-1] == "plot of accuracy per cell: no run finished"


# -- the acceptance scenario ---------------------------------------------------------------------------


@needs_plugins
def test_quick_pdsl_runs_end_to_end(verify_full, no_data, tmp_path, capsys):
    # the smallest smoke run: no lr tuning, 2 rounds, PDSL and one rival on the three graphs
    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "pdsl",
                "--quick",
                "--no-tune",
                "--set",
                "rounds=2",
                "--only",
                "method=pdsl,dp-dsgd",
                "--results-dir",
                str(tmp_path / "runs"),
                "--format",
                "markdown",
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert '| 3.0 | "ring" | 10 | pdsl |' in out and '| 3.0 | "complete" | 10 | dp-dsgd |' in out
    assert "  ours eps 3 <-> paper eps 0.1/round" in out and "REFERENCE ONLY, NOT COMPARABLE" in out
    assert "eps 3 / bipartite / M=10: not tested (" in out
    plot = next(line for line in out.splitlines() if line.startswith("plot of accuracy per cell: "))
    assert Path(plot.split(": ", 1)[1]).is_file()
    assert "one neighbouring relation for the preset: add-remove; target epsilon 3" in out
    assert "claims of the paper on digits (quick smoke run)" in out
    for claim in (
        "PDSL has the best accuracy in every cell",
        "PDSL: fully connected >= bipartite > ring",
    ):
        line = next(line for line in out.splitlines() if claim in line)
        assert ": not tested (quick smoke run; figures: " in line


def test_muffliato_gossips_several_times_and_the_table_uses_the_global_test_set(no_data):
    plan = plan_preset("pdsl", quick=True)
    muffliato = next(r.config for r in plan.runs if r.config.method == "muffliato")
    assert (
        muffliato.options["gossip_steps"] > 1 and muffliato.options["chebyshev"] is True
    )  # not DP-DPSGD again
    assert {r.config.eval_set for r in plan.runs} == {"both"} and PRESETS[
        "pdsl"
    ].metric == "final_accuracy_global_mean"


def test_the_report_says_q_is_smaller_than_the_papers():
    from p4bench_pdsl.preset_report import q_line

    line = q_line("digits")
    assert (
        line.startswith("Q, PDSL's shared validation set: ")
        and "SMALLER than the paper's 2,000" in line
    )
