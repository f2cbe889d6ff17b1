"""`p4bench reproduce`: preset plans, claim checks on known tables, and a quick run on digits."""

from __future__ import annotations

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
    assert len(plan.runs) == 6 * len(methods)  # 3 alpha + 3 shard levels, one seed
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


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100", "femnist", "digits"])
def test_shard_settings_divide_evenly(dataset):
    from p4bench.studies.reproduce import DATASETS

    classes = DATASETS[dataset]["classes"]
    for n in (2, 4, 8):
        variant = shard_variant(dataset, False, n)
        assert (variant["clients"] * n) % classes == 0 and variant["samples_per_client"] % n == 0
        assert abs(variant["clients"] - DATASETS[dataset]["clients"]) <= classes


# -- claims on known tables ----------------------------------------------------------------


def test_heterogeneity_claims_yes_and_no():
    check = PRESETS["heterogeneity"].claims
    keys = ("variant", "method")
    good = table(
        keys,
        [
            (v, m, acc)
            for v in ("alpha 25%", "shards N=2")
            for m, acc in (("p4", 0.8), ("fedavg", 0.6), ("local", 0.7), ("centralized", 0.9))
        ],
    )
    verdicts = {c.claim: c.status for c in check(good, CTX)}
    assert list(verdicts.values())[:2] == ["yes", "yes"]  # centralized is not a rival
    bad = good.copy()
    bad.loc[(bad["variant"] == "shards N=2") & (bad["method"] == "local"), "mean"] = 0.85
    best, local = check(bad, CTX)[:2]
    assert best.status == "no" and "shards N=2: p4 80.0% vs local 85.0%" in best.detail
    assert local.status == "no"


def test_privacy_and_ablation_claims():
    keys = ("variant", "epsilon")
    rows = [
        ("p4 (HC)", 3.0, 0.6),
        ("p4 (HC)", 15.0, 0.7),
        ("local", "none", 0.5),
        ("local (HC)", "none", 0.55),
    ]
    verdicts = [c.status for c in PRESETS["privacy"].claims(table(keys, rows), CTX)]
    assert verdicts == ["yes", "yes"]
    rows[0] = ("p4 (HC)", 3.0, 0.52)
    assert [c.status for c in PRESETS["privacy"].claims(table(keys, rows), CTX)] == ["no", "yes"]
    rows = [
        ("p4", 3.0, 0.7),
        ("p4 -grouping", 3.0, 0.4),
        ("p4 -scatternet", 3.0, 0.45),
        ("p4 -proxy", 3.0, 0.6),
        ("local (HC)", "none", 0.5),
    ]
    first, second = PRESETS["ablation"].claims(table(keys, rows), CTX)
    assert first.status == "yes" and second.status == "yes" and "2 of 3" in second.detail


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
        rows.append((attack, "p4-secure", 0.66))
    checks = PRESETS["defense"].claims(table(keys, rows), CTX)
    assert [c.status for c in checks] == ["yes"] * 5
    rows.append(("byzantine-zero", "krum", 0.69))
    checks = PRESETS["defense"].claims(table(keys, rows), CTX)
    assert checks[2].status == "no" and "best krum" in checks[2].detail
    keys = ("attack", "malicious_fraction", "defense")
    rows = [
        (a, f, d, 0.7 if d == "ideal" else 0.7 - (0.15 if f > 0.35 else 0.02))
        for a in ("label-flip", "byzantine-zero", "byzantine-random", "byzantine-flip")
        for f in (0.1, 0.3, 0.5)
        for d in ("p4-secure", "ideal")
    ]
    checks = {
        c.claim.split(" ")[1]: c.status for c in PRESETS["malicious"].claims(table(keys, rows), CTX)
    }
    assert checks["with"] == "yes"  # within 10 points up to 30%
    assert (
        checks["label-flip"] == "no" and checks["byzantine-zero"] == "yes"
    )  # the paper: label flip up to 50%
    only_ours = [r for r in rows if r[2] != "ideal"]
    missing = PRESETS["malicious"].claims(
        table(keys, only_ours), ClaimContext("digits", True, ("defense 'ideal'",))
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
    assert "needs the full run on cifar10" in out
