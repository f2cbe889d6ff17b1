"""`p4bench reproduce karras`: the planned runs, the CBDS claim computed from the partitioner
(and able to fail), the claims on known tables, Table III as reference values only, and a
quick smoke run on digits that prints the table and the plot's path."""

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
from p4bench.studies.reproduce import plan_preset, quick_claims
from p4bench_p2p_fl.preset import (
    FRACTIONS,
    cbds_claim,
    karras_claims,
    karras_report,
    table_iii_lines,
)

NEEDED = (
    ("method", "p2p-fl"),
    ("method", "feddf"),
    ("attack", "random-labels"),
    ("partitioner", "cbds"),
    ("model", "cnn-gray"),
)
KEYS = ("variant", "method", "malicious_fraction")
CTX = ClaimContext("digits", False, ())


def _missing() -> list[str]:
    registry = default_registry()
    return [f"{kind} '{name}'" for kind, name in NEEDED if name not in registry.names(kind)]


needs_plugins = pytest.mark.skipif(
    bool(_missing()), reason=f"karras plugins not registered yet: {', '.join(_missing())}"
)


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


def table(rows):
    return pd.DataFrame(
        [{**dict(zip(KEYS, map(str, r[:-1]))), "mean": r[-1], "std": 0.0, "n": 1} for r in rows]
    )


def seeded(rows, offsets=(-0.01, 0.0, 0.01)):
    """The claims' context with each row run on three seeds that shift every row alike."""
    runs = pd.DataFrame(
        [
            {**dict(zip(KEYS, map(str, r[:-1]))), "seed": str(s), "value": r[-1] + o}
            for r in rows
            for s, o in enumerate(offsets)
        ]
    )
    return replace(CTX, runs=runs)


# -- plans --------------------------------------------------------------------------------


@needs_plugins
def test_full_plan_on_greyscale_cifar10():
    plan = plan_preset("karras", "cifar10", check_data=False)
    assert plan.spec.name == "reproduce-karras-cifar10" and not plan.skipped
    runs = Counter((r.tags["variant"], r.config.method) for r in plan.runs)
    assert runs == {
        ("table III", "fedavg"): 3,
        ("table III", "centralized"): 3,
        ("table III: p2p", "p2p-fl"): 3,
        ("noisy clients", "fedavg"): 12,
        ("noisy clients", "feddf"): 12,
        ("noisy clients", "p2p-fl"): 12,
        ("cbds alpha 0.01", "fedavg"): 3,
        ("cbds alpha 0.01", "feddf"): 3,
        ("cbds alpha 0.01", "p2p-fl"): 3,
        ("dirichlet alpha 0.01", "fedavg"): 3,
        ("dirichlet alpha 0.01", "feddf"): 3,
        ("dirichlet alpha 0.01", "p2p-fl"): 3,
    }
    configs = [r.config for r in plan.runs]
    assert all(
        not from_config(c).private and c.no_dp and c.epsilon is None for c in configs
    )  # the paper has no DP
    assert {c.model for c in configs} == {"cnn-gray"} and all(
        c.options["grayscale"] for c in configs
    )
    assert {c.clients for c in configs} == {40} and {c.seed for c in configs} == {0, 1, 2}
    noisy = [r.config for r in plan.runs if r.tags["variant"] == "noisy clients"]
    assert {c.malicious_fraction for c in noisy} == set(FRACTIONS) and {
        c.attack for c in noisy
    } == {"random-labels"}
    assert all(c.options["cbds_alpha"] == 1.0 and c.rounds == 20 for c in noisy)
    by_method = {c.method: c for c in noisy}
    assert (
        by_method["fedavg"].client_rate == 0.5 and by_method["p2p-fl"].client_rate == 1.0
    )  # S = K/2; Alg. 3: all
    assert (
        by_method["fedavg"].options["optimizer"] == "adam"
        and by_method["fedavg"].options["epochs"] == 20
    )
    assert by_method["feddf"].options["distill_steps"] == 10_000
    assert by_method["p2p-fl"].options["policy"] == "acc-weighted"
    for method in (
        "fedavg",
        "feddf",
        "p2p-fl",
    ):  # Table II's optimiser for every method of the comparison
        assert (
            by_method[method].options["optimizer"] == "adam"
            and by_method[method].options["lr_decay"] == 0.995
        )
    exchanges = {
        r.config.options["exchange"]
        for r in plan.runs
        if r.tags["variant"].startswith("table III:")
    }
    assert exchanges == {
        "relay"
    }  # one P2P run beside both of the paper's rows (relay and mesh: identical models)
    assert {c.eval_set for c in configs} == {
        "both"
    }  # the paper's global test set, each client's own beside
    assert all(
        c.rounds == 200 and c.attack is None
        for r in plan.runs
        if r.tags["variant"] == "table III"
        for c in [r.config]
    )
    non_iid = {r.tags["variant"]: r.config for r in plan.runs if "0.01" in r.tags["variant"]}
    assert non_iid["cbds alpha 0.01"].options["cbds_alpha"] == 0.01
    assert non_iid["dirichlet alpha 0.01"].options["dirichlet_alpha"] == 0.01


@needs_plugins
def test_quick_plan_falls_back_to_digits_and_shrinks(no_data):
    plan = plan_preset("karras", quick=True)
    assert plan.dataset == "digits" and plan.spec.name == "reproduce-karras-digits-quick"
    assert len(plan.runs) == 4 + 3 * 2 + 2 and {r.config.seed for r in plan.runs} == {0}
    assert all("grayscale" not in r.config.options and r.config.rounds == 3 for r in plan.runs)


# -- claims ---------------------------------------------------------------------------------------


def test_cbds_claim_is_computed_from_the_partitioner_and_can_fail():
    check = cbds_claim()
    assert check.status in ("yes", "no") and "mean " in check.detail and "max " in check.detail
    assert "no training" in check.detail and not check.training
    impossible = cbds_claim(runs=20, mean_below=1e-6, max_at_most=1e-6)
    assert impossible.status == "no"
    # a smoke run keeps this verdict (no training behind it) but not the others'
    kept = quick_claims([impossible, check.__class__("trained", "yes", "x")])
    assert kept[0].status == "no" and kept[1].status == "not tested"


def test_robustness_and_imbalance_claims_yes_no_and_not_checked():
    cbds = cbds_claim(runs=5)
    rows = [
        ("noisy clients", "fedavg", 0.0, 0.60),
        ("noisy clients", "fedavg", 0.75, 0.20),
        ("noisy clients", "feddf", 0.0, 0.58),
        ("noisy clients", "feddf", 0.75, 0.45),
        ("cbds alpha 0.01", "fedavg", 0.0, 0.30),
        ("cbds alpha 0.01", "feddf", 0.0, 0.70),
    ]
    checks = karras_claims(table(rows), seeded(rows), cbds)
    assert [c.status for c in checks[1:]] == ["yes", "yes"]
    assert "drop 40.0 points" in checks[1].detail and "drop 13.0 points" in checks[1].detail
    assert (
        "drop of fedavg - drop of feddf +27.0 points [95% CI +27.0, +27.0], n=3" in checks[1].detail
    )
    assert "cbds alpha 0.01: feddf - fedavg +40.0 points" in checks[2].detail
    assert [c.status for c in karras_claims(table(rows), seeded(rows, (0.0,)), cbds)[1:]] == [
        "inconclusive",
        "inconclusive",
    ]  # one seed: no interval
    worse = [
        ("noisy clients", "fedavg", 0.0, 0.60),
        ("noisy clients", "fedavg", 0.75, 0.50),
        ("noisy clients", "feddf", 0.0, 0.58),
        ("noisy clients", "feddf", 0.75, 0.45),
        ("cbds alpha 0.01", "fedavg", 0.0, 0.30),
        ("cbds alpha 0.01", "feddf", 0.0, 0.29),
    ]
    assert [c.status for c in karras_claims(table(worse), seeded(worse), cbds)[1:]] == ["no", "no"]
    assert all(
        "P2P" not in c.claim and "personal" not in c.claim for c in checks
    )  # only the paper's claims
    only_fedavg = [r for r in rows if r[1] == "fedavg"]
    assert [c.status for c in karras_claims(table(only_fedavg), seeded(only_fedavg), cbds)[1:]] == [
        "not checked",
        "not checked",
    ]


def test_table_iii_is_reference_only(tmp_path):
    rows = [
        ("table III", "fedavg", 0.0, 0.5),
        ("noisy clients", "fedavg", 0.0, 0.5),
        ("noisy clients", "fedavg", 0.75, 0.3),
    ]
    lines = table_iii_lines(table(rows), "digits")
    assert "reference values only, not a pass/fail" in lines[0]
    assert "FedAvg" in lines[1] and "paper 62.1%" in lines[1] and "ours  50.0%" in lines[1]
    assert not any(word in line for line in lines for word in (": yes", ": no"))
    assert (
        sum("(table III: p2p, p2p-fl)" in line for line in lines) == 2
        and "identical models" in lines[-1]
    )
    report = karras_report(table(rows), CTX, tmp_path, "x")
    plot = tmp_path / "x-accuracy-vs-nk.png"
    assert report[-1] == f"plot of accuracy vs N_K: {plot}" and plot.stat().st_size > 0


# -- the acceptance scenario -------------------------------------------------------------------------


@needs_plugins
def test_quick_karras_runs_end_to_end_on_digits(no_data, tmp_path, capsys):
    # the smallest smoke run: no lr tuning, 1 round, the methods of the claims (no centralized)
    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "karras",
                "--quick",
                "--no-tune",
                "--set",
                "rounds=1",
                "--only",
                "method=fedavg,feddf,p2p-fl",
                "--results-dir",
                str(tmp_path / "runs"),
                "--format",
                "markdown",
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "falling back to digits" in err
    assert "| noisy clients | feddf | 0.75 |" in out and "| cbds alpha 0.01 | p2p-fl | 0.0 |" in out
    assert (
        "Table III of the paper (greyscale CIFAR-10) beside ours (digits): reference values only"
        in out
    )
    plot = next(line for line in out.splitlines() if line.startswith("plot of accuracy vs N_K: "))
    assert Path(plot.split(": ", 1)[1]).is_file()
    assert "privacy: non-private: " in out and "every run is non-private, as in the paper" in out
    assert "claims of the paper on digits (quick smoke run)" in out
    for claim in ("FedDF loses less accuracy than FedAvg", "FedDF beats FedAvg at alpha = 0.01"):
        line = next(line for line in out.splitlines() if claim in line)
        assert ": not tested (quick smoke run" in line  # a smoke run is no verdict
    cbds = next(line for line in out.splitlines() if line.startswith("- CBDS undersampling"))
    assert (
        ": yes (" in cbds or ": no (" in cbds
    )  # computed from the partitioner: a verdict even here
