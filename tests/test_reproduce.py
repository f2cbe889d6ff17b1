"""`p4bench reproduce`: preset plans, claim checks on known tables, and a quick run on digits."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from p4bench.cli import main
from p4bench.errors import UnknownNameError, UsageError
from p4bench.host.manager import default_registry
from p4bench.studies.reproduce import PRESETS, ClaimContext, plan_preset, shard_variant

CTX = ClaimContext("digits", True, ())


class Hiding:
    """The real registry with some names hidden, as if nobody had registered them yet."""

    def __init__(self, *hidden: tuple[str, str]) -> None:
        self.real, self.hidden = default_registry(), set(hidden)

    def names(self, kind):
        return [n for n in self.real.names(kind) if (kind, n) not in self.hidden]

    def get(self, kind, name):
        if (kind, name) in self.hidden:
            raise UnknownNameError(kind, name, self.names(kind))
        return self.real.get(kind, name)


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


def table(keys, rows):
    return pd.DataFrame(
        [{**dict(zip(keys, map(str, r[:-1]))), "mean": r[-1], "std": 0.0, "n": 1} for r in rows]
    )


SEEDS = (-0.01, 0.0, 0.01)  # three seeds shifting every side alike: paired differences agree


def checked(name, keys, rows, seeds=SEEDS, ctx=CTX):
    """The preset's claims on rows of (keys..., mean), each run on `seeds` (offsets from the
    mean, the same for every row: the seeds agree) or on {row index: offsets}."""
    runs = pd.DataFrame(
        [
            {**dict(zip(keys, map(str, r[:-1]))), "seed": str(s), "value": r[-1] + offset}
            for i, r in enumerate(rows)
            for s, offset in enumerate(seeds.get(i, SEEDS) if isinstance(seeds, dict) else seeds)
        ]
    )
    return PRESETS[name].claims(table(keys, rows), replace(ctx, runs=runs))


# -- plans --------------------------------------------------------------------------------


def test_missing_dataset_falls_back_to_digits_and_quick_shrinks(no_data):
    plan = plan_preset(
        "heterogeneity", quick=True, registry=Hiding(("method", "proxyfl"), ("method", "dp-dsgt"))
    )
    assert plan.dataset == "digits" and plan.spec.name == "reproduce-heterogeneity-digits-quick"
    assert any(
        "'cifar10' is not present" in n and "falling back to digits" in n for n in plan.notices
    )
    assert any(
        "method 'proxyfl'" in n and "method 'dp-dsgt'" in n and "--strict" in n
        for n in plan.notices
    )
    configs = [r.config for r in plan.runs]
    methods = {c.method for c in configs}
    assert {"p4", "fedavg", "local"} <= methods and not {"proxyfl", "dp-dsgt"} & methods
    # 3 alpha + 3 shard levels, one seed; and P4 as its paper runs it (teacher=private), a
    # reference row at every level (proxyfl's is hidden with proxyfl)
    assert len(plan.runs) == 6 * (len(methods) + 1)
    assert sum(r.tags.get("reference", "").startswith("paper's variant") for r in plan.runs) == 6
    assert all(
        c.dataset == "digits" and c.rounds == 3 and c.seed == 0 and c.clients == 10 for c in configs
    )
    assert {c.epsilon for c in configs if c.method in ("local", "centralized")} == {None}
    assert {c.epsilon for c in configs if c.method not in ("local", "centralized")} == {15.0}
    assert {r.tags["variant"] for r in plan.runs} == {
        "alpha 25%",
        "alpha 50%",
        "alpha 75%",
        "shards N=2",
        "shards N=4",
        "shards N=8",
    }
    with pytest.raises(
        UnknownNameError, match="unknown method 'proxyfl'; registered methods: .*fedavg"
    ):
        plan_preset(
            "heterogeneity", quick=True, strict=True, registry=Hiding(("method", "proxyfl"))
        )


def test_only_filter_and_overrides(no_data):
    plan = plan_preset(
        "heterogeneity", quick=True, only={"method": ["local", "p4"]}, overrides={"rounds": 2}
    )
    assert {r.config.method for r in plan.runs} == {"local", "p4"} and {
        r.config.rounds for r in plan.runs
    } == {2}
    assert any(n.startswith("restricted to method in {local, p4}") for n in plan.notices)
    with pytest.raises(UsageError, match="unknown preset 'fig9'"):
        plan_preset("fig9")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_plans_valid_runs_on_every_paper_dataset(name):
    for dataset in PRESETS[name].datasets:
        for quick in (False, True):
            plan = plan_preset(name, dataset, quick, check_data=False)
            assert plan.runs and all(r.config.dataset == dataset for r in plan.runs)
            assert {r.config.seed for r in plan.runs} == ({0} if quick else {0, 1, 2})


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100", "femnist", "digits", "mnist"])
def test_shard_settings_divide_evenly(dataset):
    from p4bench.studies.reproduce import DATASETS

    classes = DATASETS[dataset]["classes"]
    for n in (2, 4, 8):
        variant = shard_variant(dataset, False, n)
        assert (variant["clients"] * n) % classes == 0 and variant["samples_per_client"] % n == 0
        assert abs(variant["clients"] - DATASETS[dataset]["clients"]) <= classes


# -- claims on known tables ----------------------------------------------------------------


def test_heterogeneity_claims_yes_and_no():
    keys = ("variant", "method")
    good = [
        (v, m, acc)
        for v in ("alpha 25%", "shards N=2")
        for m, acc in (("p4", 0.8), ("fedavg", 0.6), ("local", 0.7), ("centralized", 0.9))
    ]
    verdicts = {c.claim: c.status for c in checked("heterogeneity", keys, good)}
    assert list(verdicts.values())[:2] == ["yes", "yes"]  # centralized is not a rival
    bad = [(v, m, 0.85 if (v, m) == ("shards N=2", "local") else acc) for v, m, acc in good]
    best, local, headline = checked("heterogeneity", keys, bad)
    assert best.status == "no" and "shards N=2: p4 - local -5.0 points [95% CI" in best.detail
    assert local.status == "no" and best.interval.mean == pytest.approx(-0.05)
    assert headline.status == "not tested" and "needs cifar10; ran digits" in headline.detail


def test_a_claim_whose_seeds_disagree_is_inconclusive_and_one_seed_says_why():
    keys = ("variant", "method")
    rows = [("alpha 25%", "p4", 0.8), ("alpha 25%", "fedavg", 0.78), ("alpha 25%", "local", 0.6)]
    # P4 - FedAvg over three seeds: +7, -3, +5 points: the interval covers 0
    disagree = {0: (0.05, -0.05, 0.03), 1: (0.0, 0.0, 0.0), 2: (0.0, 0.0, 0.0)}
    best, local = checked("heterogeneity", keys, rows, disagree)[:2]
    assert best.status == "inconclusive" and local.status == "yes"
    assert "alpha 25%: p4 - fedavg +3.0 points [95% CI" in best.detail
    assert best.interval.n == 3 and best.interval.low < 0 < best.interval.high
    assert best.seeds_needed is not None and best.seeds_needed > 3
    assert f"about {best.seeds_needed} seeds" in best.detail
    # reversed: FedAvg clearly ahead on every seed
    reversed_rows = [("alpha 25%", "p4", 0.7), ("alpha 25%", "fedavg", 0.8)]
    (best,) = checked("heterogeneity", keys, reversed_rows)[:1]
    assert best.status == "no" and "the interval lies at or below 0" in best.detail
    # one seed: no interval, whatever the difference
    one = checked("heterogeneity", keys, rows, seeds=(0.0,))
    assert [c.status for c in one[:2]] == ["inconclusive", "inconclusive"]
    assert "n=1 seed: no interval (a verdict needs at least 2 seeds)" in one[0].detail
    # a table without runs (a 0.1 caller): its means are one pseudo-seed, never a verdict
    bare = PRESETS["heterogeneity"].claims(table(keys, rows), CTX)
    assert bare[0].status == "inconclusive" and "n=1" in bare[0].detail


def test_privacy_and_ablation_claims():
    keys = ("variant", "epsilon")
    rows = [
        ("p4 (HC)", 3.0, 0.6),
        ("p4 (HC)", 15.0, 0.7),
        ("local", "none", 0.5),
        ("local (HC)", "none", 0.55),
    ]
    first, trend = checked("privacy", keys, rows)
    assert (first.status, trend.status) == ("yes", "yes")
    assert "in most cases" in first.claim and "2 yes, 0 no, 0 inconclusive of 2" in first.detail
    assert "sanity check, not a claim of the paper" in trend.claim
    rows[0] = ("p4 (HC)", 3.0, 0.52)  # below local (HC) at epsilon 3: one of two is not most
    assert [c.status for c in checked("privacy", keys, rows)] == ["no", "yes"]
    rows.append(("p4 (HC)", 8.0, 0.65))  # beats both at two of three epsilons: most
    first = checked("privacy", keys, rows)[0]
    assert first.status == "yes" and "2 yes, 1 no, 0 inconclusive of 3" in first.detail
    rows = [
        ("p4", 3.0, 0.7),
        ("p4 -grouping", 3.0, 0.4),
        ("p4 -scatternet", 3.0, 0.45),
        ("p4 -proxy", 3.0, 0.6),
        ("local (HC)", "none", 0.5),
    ]
    first, second = checked("ablation", keys, rows)
    assert first.status == "yes" and second.status == "yes"
    assert "2 yes, 1 no, 0 inconclusive of 3 (yes if more than half are yes)" in second.detail


def test_defense_and_malicious_claims():
    keys = ("attack", "defense")
    rows = [("none", "none", 0.70)]
    for attack in ("label-flip", "byzantine-zero", "byzantine-random", "byzantine-flip"):
        best = {
            "label-flip": "none",
            "byzantine-zero": "m-krum",
            "byzantine-flip": "m-krum",
            "byzantine-random": "anomaly-detection",
        }[attack]
        for defense in ("none", "m-krum", "anomaly-detection"):
            rows.append((attack, defense, 0.65 if defense == best else 0.5))
        rows += [(attack, "p4-secure", 0.66), (attack, "ideal", 0.70)]
    checks = checked("defense", keys, rows)
    assert [c.status for c in checks] == ["yes"] * 5
    # the 10-point threshold is the paper's for the gap to the ideal defense, not attack impact
    assert "ideal - p4-secure +4.0 points" in checks[0].detail
    assert "attack impact of p4-secure, figures only" in checks[0].detail
    rows.append(("byzantine-zero", "krum", 0.69))
    checks = checked("defense", keys, rows)
    assert checks[2].status == "no" and "m-krum - krum -4.0 points" in checks[2].detail
    gap = [(a, d, 0.55 if (a, d) == ("label-flip", "p4-secure") else v) for a, d, v in rows]
    assert checked("defense", keys, gap)[0].status == "no"  # a 15-point gap
    keys = ("attack", "malicious_fraction", "defense")
    rows = [
        (a, f, d, 0.7 if d == "ideal" else 0.7 - (0.15 if f > 0.35 else 0.02))
        for a in ("label-flip", "byzantine-zero", "byzantine-random", "byzantine-flip")
        for f in (0.1, 0.3, 0.5)
        for d in ("p4-secure", "ideal")
    ]
    checks = {c.claim.split(" ")[1]: c.status for c in checked("malicious", keys, rows)}
    assert checks["with"] == "yes"  # within 10 points up to 30%
    assert (
        checks["label-flip"] == "no" and checks["byzantine-zero"] == "yes"
    )  # the paper: label flip up to 50%
    only_ours = [r for r in rows if r[2] != "ideal"]
    missing = checked(
        "malicious", keys, only_ours, ctx=ClaimContext("digits", True, ("defense 'ideal'",))
    )
    assert missing[0].status == "not checked" and "ideal" in missing[0].detail


# -- the acceptance scenario -------------------------------------------------------------------


def test_quick_heterogeneity_runs_end_to_end_on_digits(verify_full, no_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "heterogeneity",
                "--quick",
                "--only",
                "method=local,p4",
                "--jobs",
                "2",
                "--results-dir",
                str(tmp_path / "runs"),
                "--format",
                "markdown",
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "falling back to digits" in err
    assert (
        "tuning lr over 0.1, 1 for p4, local on each partition's evaluation clients alone (6 partitions: "
        "6 settings x 1 seed"
    ) in err
    # tuning kept out of every reported client's privacy, and the report says how
    assert (
        "lr tuned per partition (6 partitions: 6 settings x 1 seed) on each partition's 2 evaluation clients "
        "alone, disjoint from its 8 reported clients: no reported client's record enters the tuning of its "
        "run's lr"
    ) in out
    assert "lr per method (tuned per partition): p4 " in out
    # P4 private (add-remove, no defense: nobody attacks), local non-private: the table marks both
    assert out.count("| p4 | add-remove |") == 6 and out.count("| local | non-private |") == 6
    assert (
        "tuning runs' own privacy (not reported): private, add-remove neighbouring, certified epsilon: p4; "
        "non-private: local; delta "
    ) in out
    assert "one neighbouring relation for the preset: add-remove; target epsilon 15" in out
    assert "claims of the paper on digits (quick smoke run)" in out
    for claim in (
        "P4 has the best accuracy at every heterogeneity level",
        "P4 beats local training at every",
    ):
        line = next(line for line in out.splitlines() if claim in line)
        assert ": not tested (quick smoke run" in line  # a smoke run is no verdict
    assert "needs cifar10; ran digits" in out


def test_a_claim_check_written_against_0_1_keeps_working():
    from p4bench.api import ClaimCheck

    check = ClaimCheck("text", "yes")
    assert (check.detail, check.training, check.interval, check.seeds_needed) == (
        "",
        True,
        None,
        None,
    )
    assert ClaimContext("digits", False, ()).runs is None
