"""Reference rows (#46): the papers' own P4 and ProxyFL (`teacher=private`, uncertified)
beside the certified ones, and a non-private centralized ceiling in every preset where it
fits. A declared reference row is a row of its own, may be uncertified (marked), and is
never a side of a claim; an uncertified run that is not declared is refused as before."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from p4bench.host.manager import default_registry
from p4bench.studies.claims import ClaimContext, run_values, seed_runs, without_references
from p4bench.studies.compare import compare_experiment
from p4bench.studies.equal_privacy import (
    RunPrivacy,
    UnequalPrivacyError,
    check_privacy,
    from_config,
    from_row,
)
from p4bench.studies.reproduce import PRESETS, plan_preset
from p4bench.studies.run_task import RunRecord
from p4bench.studies.sweep import expand, parse_sweep
from p4bench.studies.sweep_plan import REFERENCE, describe_run
from p4bench.studies.sweep_privacy import uncertified_notice
from p4bench_p4.presets import CEILING, PAPER_VARIANT

LEVELS = {"alpha 25%", "alpha 50%", "alpha 75%", "shards N=2", "shards N=4", "shards N=8"}
PAPER_METHODS = ("p4", "proxyfl")
CEILINGS = ("heterogeneity", "privacy", "ablation", "karras", "p4l", "pdsl")


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


# -- (a) the papers' variant beside the certified one, at every level ----------------------------


@pytest.mark.parametrize("quick", [True, False])
def test_heterogeneity_runs_p4_and_proxyfl_as_their_papers_do_at_every_level(no_data, quick):
    plan = plan_preset("heterogeneity", "cifar10", quick, check_data=False)
    paper = [r for r in plan.runs if r.tags.get(REFERENCE) == PAPER_VARIANT]
    pairs = {(m, v) for m in PAPER_METHODS for v in LEVELS}
    assert {(r.config.method, r.tags["variant"]) for r in paper} == pairs
    assert len(paper) == len(pairs) * (1 if quick else 3)  # every seed
    assert all(r.config.options["teacher"] == "private" and r.config.epsilon == 15.0 for r in paper)
    assert all("(reference)" in describe_run(r) for r in paper)
    certified = [
        r for r in plan.runs if r.config.method in PAPER_METHODS and REFERENCE not in r.tags
    ]
    assert {(r.config.method, r.tags["variant"]) for r in certified} == pairs
    assert all(r.config.options.get("teacher", "none") == "none" for r in certified)
    # the certified run of a method and level comes first: lr tuning picks it, and the
    # paper's variant runs at the certified one's tuned lr
    first: dict[tuple[str, str], object] = {}
    for run in plan.runs:
        first.setdefault((run.config.method, run.tags["variant"]), run)
    assert all(REFERENCE not in first[pair].tags for pair in pairs)


def test_the_papers_variant_is_uncertified_and_the_certified_one_is_not(no_data):
    plan = plan_preset("heterogeneity", quick=True)
    registry = default_registry()

    def reasons(run):
        cls = registry.get("method", run.config.method)
        return cls(run.config, model=None, num_clients=run.config.clients).uncertified_steps()

    for method in PAPER_METHODS:
        runs = [r for r in plan.runs if r.config.method == method]
        assert all(bool(reasons(r)) == (REFERENCE in r.tags) for r in runs), method


# -- (b) a non-private centralized ceiling ------------------------------------------------------


@pytest.mark.parametrize("name", CEILINGS)
def test_every_preset_with_a_ceiling_runs_centralized_non_private_as_a_reference(name, no_data):
    for quick in (True, False):
        plan = plan_preset(name, PRESETS[name].datasets[0], quick, check_data=False)
        central = [r for r in plan.runs if r.config.method == "centralized"]
        assert central, name
        assert all(r.tags.get(REFERENCE) == "non-private pooled ceiling" for r in central)
        assert not any(from_config(r.config).private for r in central)
    assert "non-private pooled ceiling" in PRESETS[name].baselines


@pytest.mark.parametrize("name", ["defense", "malicious"])
def test_presets_keyed_by_attack_and_defense_say_why_they_have_no_ceiling(name, no_data):
    plan = plan_preset(name, quick=True)
    assert not any(r.config.method == "centralized" for r in plan.runs)
    assert PRESETS[name].baselines.startswith("no centralized ceiling: rows are keyed by attack")


# -- (c) only a declared reference row may be uncertified ---------------------------------------


def test_an_uncertified_run_passes_only_when_declared_a_reference_row():
    certified = RunPrivacy("p4 seed=0", "p4", True, "add-remove")
    paper = RunPrivacy(
        "p4 paper seed=0", "p4", True, "add-remove", False, "teacher=private", reference="paper"
    )
    verdict = check_privacy([certified, paper, RunPrivacy("local", "local", False)])
    assert verdict.ok and [r.mark for r in verdict.runs] == [
        "add-remove",
        "add-remove UNCERTIFIED",
        "non-private",
    ]
    assert "epsilon UNCERTIFIED: p4 (reference)" in verdict.note()
    undeclared = replace(paper, run="p4 undeclared seed=0", reference=None)
    with pytest.raises(UnequalPrivacyError, match="uncertified epsilon: p4 undeclared seed=0"):
        check_privacy([certified, undeclared])
    # a reference row is exempt from certification only, not from the one relation
    with pytest.raises(UnequalPrivacyError, match="different neighbouring relations"):
        check_privacy([certified, replace(paper, neighbouring="replace-one")])
    # read back from MLflow: the `reference` tag declares it
    row = {
        "method": "p4",
        "dp.private": "true",
        "dp.certified": "false",
        "dp.neighbouring": "add-remove",
        "dp.uncertified_reason": "teacher=private",
    }
    assert from_row({**row, REFERENCE: PAPER_VARIANT}).reference == PAPER_VARIANT
    check_privacy([certified, from_row({**row, REFERENCE: PAPER_VARIANT})])
    with pytest.raises(UnequalPrivacyError, match="uncertified epsilon: p4"):
        check_privacy([certified, from_row({**row, REFERENCE: float("nan")})])


def test_a_sweep_names_its_undeclared_uncertified_runs_only():
    base = {"dataset": "digits", "clients": 8, "rounds": 2, "epsilon": 5.0, "method": "fedavg"}
    spec = parse_sweep(
        {
            "name": "u",
            "base": base,
            "variants": [{"label": "plain"}, {"label": "paper", REFERENCE: "why", "seed": 1}],
        }
    )
    planned = expand(spec)
    assert [r.tags.get(REFERENCE) for r in planned] == [None, "why"]
    summary = {"private": True, "epsilon_certified": False, "neighbouring": "add-remove"}
    records = [RunRecord(r.config_hash, "finished", summary=dict(summary)) for r in planned]
    notice = uncertified_notice(planned, records)
    assert notice is not None and "fedavg plain seed=0" in notice and "paper" not in notice
    assert uncertified_notice(planned[1:], records[1:]) is None


# -- (d) no claim reads a reference row ---------------------------------------------------------


def _log(client, experiment, method, seed, accuracy, *, reference=None, certified=True):
    private = method not in ("local", "centralized")
    tags = {
        "method": method,
        "variant": "alpha 25%",
        "attack": "none",
        "defense": "none",
        "seed": str(seed),
        "config_hash": f"{method}-{seed}-{certified}",
        "dp.private": str(private).lower(),
        "dp.certified": str(certified and private).lower(),
        **({"dp.neighbouring": "add-remove"} if private else {}),
        **({"dp.uncertified_reason": "teacher=private"} if private and not certified else {}),
        **({REFERENCE: reference} if reference else {}),
    }
    run_id = client.create_run(experiment, tags=tags).info.run_id
    params = {"method": method, "seed": str(seed), "epsilon": "15.0" if private else "none"}
    client.log_batch(
        run_id,
        params=[Param(k, v) for k, v in params.items()],
        metrics=[Metric("final_accuracy_mean", accuracy, 0, 0)],
    )
    client.set_terminated(run_id, "FINISHED")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three seeds at one level: certified p4 below fedavg, the paper's p4 far above both."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('references') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    for name, declared in (("declared", True), ("undeclared", False)):
        experiment = client.create_experiment(name)
        for seed, offset in enumerate((-0.01, 0.0, 0.01)):
            _log(client, experiment, "p4", seed, 0.60 + offset)
            _log(client, experiment, "fedavg", seed, 0.70 + offset)
            _log(client, experiment, "local", seed, 0.50 + offset)
            _log(
                client,
                experiment,
                "p4",
                seed,
                0.95 + offset,
                certified=False,
                reference=PAPER_VARIANT if declared else None,
            )
            _log(client, experiment, "centralized", seed, 0.99, reference=CEILING)
    return uri


def test_reference_rows_are_rows_of_their_own_and_an_undeclared_one_is_refused(store):
    comparison = compare_experiment(store, "declared", ["variant", "method"])
    assert comparison.group_by == ["variant", "method", "privacy", "reference"]
    rows = {
        (r["method"], r["reference"]): (r["privacy"], round(r["mean"], 4))
        for r in comparison.table.to_dict("records")
    }
    assert rows == {
        ("centralized", CEILING): ("non-private", 0.99),
        ("fedavg", "-"): ("add-remove", 0.7),
        ("local", "-"): ("non-private", 0.5),
        ("p4", "-"): ("add-remove", 0.6),
        ("p4", PAPER_VARIANT): ("add-remove UNCERTIFIED", 0.95),
    }
    with pytest.raises(UnequalPrivacyError, match="uncertified epsilon: p4 'alpha 25%'"):
        compare_experiment(store, "undeclared", ["variant", "method"])


def test_no_claim_reads_a_reference_row_as_the_method_it_runs(store):
    """As `reproduce` calls them: P4's claims on the table and runs without reference rows.
    The certified p4 loses to fedavg at every seed; read with the paper's p4 it would win."""
    comparison = compare_experiment(store, "declared", ["variant", "method"])
    ctx = ClaimContext("digits", False, (), runs=run_values(comparison))
    assert REFERENCE not in ctx.runs.columns
    assert sorted(set(ctx.runs["method"])) == ["fedavg", "local", "p4"]
    claims = PRESETS["heterogeneity"].claims
    best, local, _ = claims(without_references(comparison.table), ctx)
    assert best.status == "no" and "alpha 25%: p4 - fedavg -10.0 points" in best.detail
    assert local.status == "yes" and "p4 - local +10.0 points" in local.detail
    # the full table too: the runs a claim pairs never hold a reference row
    assert claims(comparison.table, ctx)[0].status == "no"
    no_runs = replace(ctx, runs=None)
    assert set(seed_runs(comparison.table, no_runs)["method"]) == {"fedavg", "local", "p4"}
    assert "p4 - fedavg -10.0 points" in claims(comparison.table, no_runs)[0].detail
    # what a leak would say (the paper's p4 pooled with the certified one): the test can fail
    leaked = pd.concat(
        [
            ctx.runs,
            pd.DataFrame(
                [
                    {"variant": "alpha 25%", "method": "p4", "seed": str(s), "value": 0.95 + o}
                    for s, o in enumerate((-0.01, 0.0, 0.01))
                ]
            ),
        ]
    )
    assert claims(without_references(comparison.table), replace(ctx, runs=leaked))[0].status == (
        "yes"
    )


def test_without_references_keeps_a_table_that_has_none():
    table = pd.DataFrame({"method": ["p4"], "mean": [0.5]})
    assert without_references(table) is table
    marked = table.assign(reference=[CEILING])
    assert without_references(marked).empty and REFERENCE not in without_references(marked)
