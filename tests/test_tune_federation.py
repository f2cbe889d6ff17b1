"""Tuning inside the privacy story (#29 item 4): tuning runs train on the evaluation clients
alone by default, so no reported client's record takes part; `tune_on: federation` keeps
the whole federation and says that the tuned values are then not covered by the accounting.
`reproduce` tunes per partition (`--tune-scope partition`): every reported run's lr comes from
its own partition's evaluation clients; `--tune-scope preset` tunes once and says its caveat."""

from __future__ import annotations

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from test_equal_privacy import FakeBackend

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.host.manager import default_registry
from p4bench.run.runner import prepare
from p4bench.studies.reproduce import PRESETS, plan_lr_tuning, plan_preset, reproduce
from p4bench.studies.sweep import PlannedRun
from p4bench.studies.tune import TuneSpec, parse_tune, plan_tuning, run_tuning, write_tuned
from p4bench.studies.tune_federation import check_tuning_federation, tuning_config, tuning_note
from p4bench.studies.tune_scope import (
    lr_summary,
    lr_table,
    partition_key,
    partition_shape,
    plan_lr_groups,
    scope_note,
)

TINY = {"dataset": "digits", "clients": 10, "rounds": 1, "local_steps": 1, "seed": 3}


def _clients(tensors, index):
    """Each listed client's valid samples and labels (padding dropped)."""
    return [(tensors.x[i, : int(tensors.n[i])], tensors.y[i, : int(tensors.n[i])]) for i in index]


def test_a_tuning_run_holds_exactly_the_evaluation_clients_of_the_reported_partition():
    reported = RunConfig(method="p4", epsilon=15.0, neighbouring="add-remove", **TINY)
    tuning = tuning_config(reported, "evaluation-clients")
    assert (tuning.clients, tuning.federation_clients) == (2, 10)
    registry = default_registry()
    whole, alone = prepare(reported, registry), prepare(tuning, registry)
    evaluation = torch.nonzero(whole.job.data.evaluation).flatten().tolist()
    assert (
        len(evaluation) == 2
        and alone.job.data.num_clients == 2
        and bool(alone.job.data.evaluation.all())
    )
    for split in ("train", "test"):  # the same tensors, client by client, in the same order
        kept, theirs = (
            _clients(getattr(alone.job.data, split), range(2)),
            _clients(getattr(whole.job.data, split), evaluation),
        )
        assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kept, theirs))
    held = {int(i) for indices in alone.job.data.client_indices for i in indices}
    reported_records = {
        int(i) for c in range(10) if c not in evaluation for i in whole.job.data.client_indices[c]
    }
    assert held == {int(i) for c in evaluation for i in whole.job.data.client_indices[c]}
    assert not held & reported_records  # no reported client's record, train or test
    # the tuning runs' privacy is stated with the reported runs' delta (1/(10 N), N the data set's records)
    assert (
        alone.ledger is not None
        and whole.ledger is not None
        and alone.ledger.delta == whole.ledger.delta
    )


def test_plans_say_which_federation_and_tag_it():
    spec = parse_tune({"base": TINY, "grid": {"lr": [0.1, 1.0]}, "methods": ["fedavg"]})
    assert spec.tune_on == "evaluation-clients"
    planned = plan_tuning(spec)
    assert {(r.config.clients, r.config.federation_clients) for _, r in planned} == {(2, 10)}
    assert {r.tags["tune_on"] for _, r in planned} == {"evaluation-clients"}
    old = plan_tuning(
        parse_tune(
            {"base": TINY, "grid": {"lr": [0.1]}, "methods": ["fedavg"], "tune_on": "federation"}
        )
    )
    assert [(r.config.clients, r.config.federation_clients, r.tags["tune_on"]) for _, r in old] == [
        (10, None, "federation")
    ]
    with pytest.raises(UsageError, match="tune_on must be one of"):
        parse_tune({"grid": {"lr": [1]}, "methods": ["fedavg"], "tune_on": "everyone"})
    # reproduce tunes on the evaluation clients of its tuning setting's partition, unless asked otherwise
    plan = plan_preset(
        "heterogeneity", "digits", True, check_data=False, only={"method": ["fedavg"]}
    )
    alone = plan_lr_tuning(
        PRESETS["heterogeneity"], plan.runs, "x-tune", (0.1, 1.0), scope="preset"
    )
    whole = plan_lr_tuning(
        PRESETS["heterogeneity"], plan.runs, "x-tune", (0.1,), tune_on="federation"
    )
    assert {(r.config.clients, r.config.federation_clients) for _, r in alone} == {(2, 10)}
    assert [(r.config.clients, r.config.federation_clients) for _, r in whole] == [
        (10, None)
    ] * 6  # per partition
    reported_delta = {r.config.delta for r in plan.runs}
    assert {
        r.config.delta for _, r in alone
    } == reported_delta  # the runs' delta is not touched by tuning


def test_notes_say_which_mode():
    reported = RunConfig(**TINY)
    line = tuning_note("evaluation-clients", [tuning_config(reported, "evaluation-clients")])
    assert line.startswith(
        "lr tuned on the 2 evaluation clients alone (disjoint from the 8 reported clients): "
        "tuning spends none of the reported clients' privacy"
    )
    old = tuning_note("federation", [tuning_config(reported, "federation")])
    assert "whole federation" in old and "not covered by the privacy accounting" in old


def test_too_few_evaluation_clients_is_one_clear_usage_error(tmp_path, capsys):
    with pytest.raises(UsageError, match="needs at least 2 of them.*gives 1"):
        tuning_config(RunConfig(**{**TINY, "clients": 5}), "evaluation-clients")
    tuning_config(RunConfig(**{**TINY, "clients": 5}), "federation")  # the whole federation is fine
    with pytest.raises(UsageError, match="p4l on the 2 evaluation clients alone.*at least 3"):
        check_tuning_federation(
            [tuning_config(RunConfig(method="p4l", **TINY), "evaluation-clients")]
        )
    with pytest.raises(SystemExit) as info:
        main(
            [
                "tune",
                "--method",
                "fedavg",
                "--grid",
                "lr=0.1",
                "--set",
                "clients=5",
                "--results-dir",
                str(tmp_path),
                "--output",
                str(tmp_path / "t.yaml"),
            ]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "needs at least 2 of them" in err and "Traceback" not in err
    # asked for, the whole federation tunes (and the output and file say what that means)
    with pytest.raises(SystemExit) as info:
        main(
            [
                "tune",
                "--method",
                "fedavg",
                "--grid",
                "lr=0.1",
                "--set",
                "clients=5",
                "--set",
                "rounds=1",
                "--tune-on",
                "federation",
                "--results-dir",
                str(tmp_path),
                "--output",
                str(tmp_path / "t.yaml"),
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "not covered by the privacy accounting" in out
    assert yaml.safe_load((tmp_path / "t.yaml").read_text())["selection"]["tune_on"] == "federation"


@pytest.mark.parametrize("tune_on", ["evaluation-clients", "federation"])
def test_both_modes_run_and_record_which(tune_on, tmp_path):
    spec = TuneSpec(
        "tf",
        {**TINY, "results_dir": str(tmp_path)},
        {"fedavg": {"lr": (0.1, 1.0)}},
        (3,),
        tune_on=tune_on,
    )
    result = run_tuning(spec)
    assert set(result.best) == {"fedavg"} and all(p.scores for p in result.points["fedavg"])
    document = yaml.safe_load(write_tuned(result, tmp_path / "tuned.yaml").read_text())
    assert (
        document["selection"]["tune_on"] == tune_on
        and document["selection"]["federation"] == result.scope
    )
    alone = tune_on == "evaluation-clients"
    assert ("evaluation clients alone" in result.scope) == alone and (
        "not covered" in result.scope
    ) == (not alone)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tf").experiment_id])
    assert len(runs) == 2 and {r.data.tags["tune_on"] for r in runs} == {tune_on}
    assert {r.data.params["clients"] for r in runs} == {"2" if alone else "10"}


# -- which reported runs one tuning serves (reproduce's --tune-scope) ------------------------------


def _two_levels_two_seeds():
    """Reported local runs (raw features: no ScatterNet to compute) at two heterogeneity levels
    and two seeds: four partitions."""
    plan = plan_preset(
        "heterogeneity",
        "digits",
        True,
        check_data=False,
        only={"method": ["local"]},
        overrides={"features": "raw"},
    )
    runs = [r for r in plan.runs if r.tags.get("variant") in ("alpha 25%", "shards N=2")]
    return runs + [PlannedRun(r.config.replace(seed=1), r.tags) for r in runs]


def _records(config, registry):
    """(every evaluation client's pooled records, every reported client's) of a run's partition."""
    data = prepare(config, registry).job.data
    evaluation = set(torch.nonzero(data.evaluation).flatten().tolist())
    held = [{int(i) for i in indices} for indices in data.client_indices]
    return (
        {i for c, r in enumerate(held) if c in evaluation for i in r},
        {i for c, r in enumerate(held) if c not in evaluation for i in r},
    )


def test_partition_scope_tunes_every_reported_run_on_its_own_partitions_evaluation_clients():
    runs = _two_levels_two_seeds()
    plan = plan_lr_groups(PRESETS["heterogeneity"].tune_at, runs, "x-tune", (0.1, 1.0))
    assert plan.scope == "partition" and len(plan.groups) == 4 and len(plan.planned) == 8
    assert partition_shape(plan) == "4 partitions: 2 settings x 2 seeds"
    tuned = {
        name: [run for group, run in plan.planned if group == name] for name in plan.assignment
    }
    for name, reported in zip(plan.assignment, runs):
        assert [run.config.lr for run in tuned[name]] == [0.1, 1.0]
        for run in tuned[name]:  # the reported run's partition, its evaluation clients alone
            whole = run.config.replace(
                clients=run.config.federation_clients, federation_clients=None
            )
            assert (
                partition_key(whole) == partition_key(reported.config)
                and run.config.seed == reported.config.seed
            )
            assert run.config.clients == 2 and run.tags["tune_partition"] in name
    # behaviour: the records of the tuning run that chose each reported run's lr are exactly the
    # evaluation clients' records of that run's partition, none of its reported clients'
    registry = default_registry()
    for name, reported in zip(plan.assignment, runs):
        evaluation, reported_records = _records(reported.config, registry)
        held = {
            int(i)
            for indices in prepare(tuned[name][0].config, registry).job.data.client_indices
            for i in indices
        }
        assert held == evaluation and not held & reported_records
    # the lr each run gets is its own partition's
    lrs = {group.name: 0.1 * (i + 1) for i, group in enumerate(plan.groups)}
    assert [run.config.lr for run in plan.apply(lrs)] == [lrs[name] for name in plan.assignment]
    assert lr_summary(plan, lrs).startswith("local 0.1 (1 partition), 0.2 (1)")
    header, rows = lr_table(plan, lrs)
    assert header == ["partition", "local"] and [row[0] for row in rows] == [
        "alpha 25%, seed 0",
        "shards N=2, seed 0",
        "alpha 25%, seed 1",
        "shards N=2, seed 1",
    ]
    assert lr_table(plan, dict.fromkeys(lrs, 0.5)) is None  # one lr everywhere: the summary says it
    note = scope_note(plan)
    assert note == (
        "lr tuned per partition (4 partitions: 2 settings x 2 seeds) on each partition's 2 evaluation "
        "clients alone, disjoint from its 8 reported clients: no reported client's record enters the "
        "tuning of its run's lr (--tune-scope partition)"
    )


def test_preset_scope_tunes_once_and_its_records_can_be_reported_clients_elsewhere():
    runs = _two_levels_two_seeds()
    plan = plan_lr_groups(PRESETS["heterogeneity"].tune_at, runs, "x-tune", (0.1,), scope="preset")
    assert [g.name for g in plan.groups] == ["local"] and set(plan.assignment) == {"local"}
    assert scope_note(plan) is None  # tuning_note's line, with its caveat, says it
    registry = default_registry()
    held = {
        int(i)
        for indices in prepare(plan.planned[0][1].config, registry).job.data.client_indices
        for i in indices
    }
    assert any(
        held & _records(run.config, registry)[1] for run in runs
    )  # the gap the partition scope closes
    with pytest.raises(UsageError, match="tune scope must be one of partition, preset"):
        plan_lr_groups({}, runs, "x", (0.1,), scope="method")


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


def test_reproduce_says_which_scope(no_data, tmp_path):
    preset = reproduce(
        "heterogeneity",
        quick=True,
        backend=FakeBackend(),
        results_dir=str(tmp_path),
        only={"method": ["local"]},
        tune_grid=(0.1,),
        tune_scope="preset",
    )
    assert preset.tuning_plan.scope == "preset" and list(preset.tuned_lr) == ["local"]
    line = next(
        line
        for line in preset.privacy
        if line.startswith("lr tuned on the 2 evaluation clients alone")
    )
    assert (
        "runs at other settings or seeds partition the data anew" in line
        and "--tune-scope partition tunes" in line
    )
    exact = reproduce(
        "heterogeneity",
        quick=True,
        backend=FakeBackend(),
        results_dir=str(tmp_path),
        only={"method": ["local"]},
        tune_grid=(0.1,),
    )
    assert len(exact.tuned_lr) == 6 and any(
        line.startswith("lr tuned per partition (6 partitions: 6 settings x 1 seed)")
        for line in exact.privacy
    )
    assert any(
        "tuning lr over 0.1 for local on each partition's evaluation clients alone (6 partitions"
        in n
        for n in exact.notices
    )


def test_reproduce_prints_the_lr_of_every_partition_where_they_differ(
    no_data, tmp_path, capsys, monkeypatch
):
    import p4bench.studies.backends

    best = lambda c: 0.1 if c.partitioner == "alpha" else 1.0  # noqa: E731 - lr best on its partition
    monkeypatch.setattr(
        p4bench.studies.backends,
        "make_backend",
        lambda *a, **k: FakeBackend(score=lambda c: 1.0 - abs(c.lr - best(c))),
    )
    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "heterogeneity",
                "--quick",
                "--only",
                "method=local",
                "--results-dir",
                str(tmp_path),
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "lr per partition (tuned on its evaluation clients alone):" in out
    assert "  alpha 25%, seed 0: local 0.1" in out and "  shards N=8, seed 0: local 1" in out
    assert "lr per method (tuned per partition): local 0.1 (3 partitions), 1 (3)" in out
    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "heterogeneity",
                "--quick",
                "--tune-scope",
                "level",
                "--results-dir",
                str(tmp_path),
            ]
        )
    assert (
        info.value.code == 2
        and "tune scope must be one of partition, preset" in capsys.readouterr().err
    )
