"""Sweeps: expansion, resuming from MLflow, failures, worker processes, and the CLI."""

from __future__ import annotations

import csv
import io
import math

import pytest
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.errors import ConfigError, UnknownNameError, UsageError
from p4bench.studies.backends import LocalBackend, RunTask, execute_task
from p4bench.studies.sweep import expand, load_sweep, parse_sweep, run_sweep

TINY = {"dataset": "digits", "clients": 8, "rounds": 2, "local_steps": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One results folder (and MLflow store) for the module: creating a store costs seconds."""
    return str(tmp_path_factory.mktemp("store") / "runs")


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


# -- expansion (no training) --------------------------------------------------------------


def test_axes_expand_to_their_cartesian_product_with_none_and_plugin_options():
    spec = parse_sweep(
        {
            "name": "grid",
            "base": {**TINY, "local-steps": 3},
            "axes": {
                "method": ["local", "fedavg"],
                "attack": ["none", "label-flip"],
                "defense": ["none", None],
                "options.group_size": [2, 4],
                "seed": [0, 1],
            },
        }
    )
    planned = expand(spec)
    assert len(planned) == 2 * 2 * 2 * 2 * 2
    configs = [p.config for p in planned]
    assert {c.attack for c in configs} == {None, "label-flip"}  # `none` = no attack
    assert {c.defense for c in configs} == {
        "none",
        None,
    }  # `none` = no defense, null = the method's default
    assert {c.options["group_size"] for c in configs} == {2, 4}
    assert all(c.experiment == "grid" and c.local_steps == 3 for c in configs)
    assert all(p.tags["sweep"] == "grid" for p in planned)
    assert len({p.config_hash for p in planned}) == len(planned)


def test_precedence_variants_tuned_include_and_duplicates(tmp_path):
    (tmp_path / "tuned.yaml").write_text(
        "tuned:\n  fedavg: {lr: 0.7, local_steps: 4}\n  p4: {lr: 2.0}\n"
    )
    (tmp_path / "sweep.yaml").write_text(
        "name: prec\n"
        "base: {lr: 0.1, epsilon: 15, clients: 8}\n"
        "include: tuned.yaml\n"
        "per_method: {local: {epsilon: none}}\n"
        "axes: {method: [fedavg, local, p4], local_steps: [1]}\n"
        "variants:\n"
        "  - {label: 'alpha 25%', partitioner: alpha, similarity: 0.25}\n"
        "  - {label: 'p4 fast', method: p4, lr: [3.0, 3.0]}\n"
    )
    planned = expand(load_sweep(tmp_path / "sweep.yaml"))
    by = {(p.tags["variant"], p.config.method): p.config for p in planned}
    assert by[("alpha 25%", "fedavg")].lr == 0.7  # tuned beats base
    assert by[("alpha 25%", "fedavg")].local_steps == 1  # axes beat tuned values
    assert by[("alpha 25%", "local")].epsilon is None and by[("alpha 25%", "local")].lr == 0.1
    assert by[("alpha 25%", "p4")].lr == 2.0 and by[("alpha 25%", "p4")].similarity == 0.25
    assert by[("p4 fast", "p4")].lr == 3.0  # a variant beats everything
    # the 'p4 fast' variant forces method=p4 for all three axis values and lists lr twice: one run
    assert sum(1 for p in planned if p.tags["variant"] == "p4 fast") == 1


def test_bad_sweep_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="'name'"):
        parse_sweep({"axes": {"seed": [0]}})
    with pytest.raises(UsageError, match="unknown key"):
        parse_sweep({"name": "x", "axis": {}})
    with pytest.raises(ConfigError, match="unknown run option"):
        parse_sweep({"name": "x", "axes": {"learning_rate": [0.1]}})
    with pytest.raises(ConfigError, match="clients"):
        expand(parse_sweep({"name": "x", "axes": {"clients": [8, 1]}}))
    with pytest.raises(UsageError, match="not found"):
        load_sweep(tmp_path / "missing.yaml")


def test_unknown_plugin_name_fails_before_any_run(results_dir, monkeypatch):
    import p4bench.run.runner

    monkeypatch.setattr(p4bench.run.runner, "run", lambda *a, **k: pytest.fail("no run may start"))
    spec = parse_sweep({"name": "typo", "base": TINY, "axes": {"method": ["fedavg", "fedavgg"]}})
    with pytest.raises(UnknownNameError, match="unknown method 'fedavgg'.*fedavg"):
        run_sweep(spec, results_dir=results_dir, track=False)


# -- executing ----------------------------------------------------------------------------


def test_failing_run_is_recorded_and_the_others_finish(store):
    spec = parse_sweep(
        {
            "name": "failing",
            "base": {**TINY, "method": "p4", "rounds": 1},
            "axes": {"options.group_size": [2, 99], "seed": [0]},
        }
    )
    report = run_sweep(spec, results_dir=store)
    statuses = [r.status for r in report.records]
    assert statuses == ["finished", "failed"]
    failed = report.failures[0][1]
    assert "group_size" in failed.error
    client = MlflowClient(tracking_uri=report.tracking_uri)
    failed_run = client.get_run(failed.mlflow_run_id)
    assert failed_run.info.status == "FAILED" and "group_size" in failed_run.data.tags["error"]
    assert (
        failed_run.data.tags["sweep"] == "failing"
        and failed_run.data.tags["config_hash"] == failed.config_hash
    )
    # resuming retries only the failed run
    again = run_sweep(spec, results_dir=store)
    assert [r.status for r in again.records] == ["skipped", "failed"]


def test_worker_processes_give_the_same_per_round_metrics_as_in_process(small_config):
    # one task keeps it to one spawned worker (the reproduce test runs two in parallel)
    tasks = [
        RunTask(small_config(method="p4", rounds=2, seed=3).to_dict(), track=False, autoload=False)
    ]
    in_process = [execute_task(t) for t in tasks]
    records = {}
    LocalBackend(jobs=2).map(tasks, lambda i, record: records.__setitem__(i, record))
    for index, reference in enumerate(in_process):
        assert reference.status == records[index].status == "finished"
        assert records[index].rounds == reference.rounds  # exactly, round by round
        assert (
            records[index].summary["accuracy_per_client"]
            == reference.summary["accuracy_per_client"]
        )


# -- the acceptance scenario through the CLI ----------------------------------------------------


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory, store):
    path = tmp_path_factory.mktemp("sweep") / "sweep.yaml"
    path.write_text(
        "name: two-by-two\n"
        "base: {dataset: digits, clients: 8, rounds: 2, local_steps: 2}\n"
        "axes:\n  method: [local, fedavg]\n  attack: [none, label-flip]\n  seed: [0, 1]\n"
    )
    return path, store


def test_sweep_runs_every_combination_into_one_experiment(finished_sweep, capsys):
    path, results = finished_sweep
    code, out, err = invoke(["sweep", str(path), "--results-dir", results, "--json"], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 8 and all('"status": "finished"' in line for line in lines)
    assert "sweep two-by-two" in err  # the progress bar
    client = MlflowClient(tracking_uri=f"sqlite:///{results}/mlflow.db")
    experiment = client.get_experiment_by_name("two-by-two")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 8
    assert {r.data.tags["sweep"] for r in runs} == {"two-by-two"}
    assert len({r.data.tags["config_hash"] for r in runs}) == 8
    assert all(r.info.status == "FINISHED" for r in runs)


def test_compare_prints_four_groups_with_mean_std_and_n(finished_sweep, capsys):
    _, results = finished_sweep
    code, out, err = invoke(
        ["compare", "--experiment", "two-by-two", "--results-dir", results, "--format", "csv"],
        capsys,
    )
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 4
    assert {(r["method"], r["attack"]) for r in rows} == {
        (m, a) for m in ("local", "fedavg") for a in ("none", "label-flip")
    }
    for row in rows:
        assert row["n"] == "2" and 0 <= float(row["mean"]) <= 1 and math.isfinite(float(row["std"]))
    code, out, _ = invoke(
        [
            "compare",
            "--experiment",
            "two-by-two",
            "--results-dir",
            results,
            "--group-by",
            "method,attack",
        ],
        capsys,
    )
    assert code == 0 and "label-flip" in out and "mean" in out and "std" in out


def test_running_the_sweep_again_trains_nothing(finished_sweep, capsys, monkeypatch):
    import p4bench.run.runner

    monkeypatch.setattr(
        p4bench.run.runner, "run", lambda *a, **k: pytest.fail("a finished run was trained again")
    )
    path, results = finished_sweep
    code, out, err = invoke(["sweep", str(path), "--results-dir", results, "--json"], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 8 and all('"status": "skipped"' in line for line in lines)
    assert "8 of 8 runs already finished" in err
