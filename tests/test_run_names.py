"""Truthful counts and names: rounds as configured (a phase before them reported on its
own), resolved plugin names in MLflow params, run names `method-attack-defense-dataset-seed`."""

from __future__ import annotations

import io

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from p4bench.cli.run import ProgressDisplay
from p4bench.cli.summary_table import _rounds_text, print_summary
from p4bench.config import RunConfig
from p4bench.run.runner import run
from p4bench.studies.backends import RunTask, execute_task
from p4bench.tracking.tracker import run_name


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One results folder and MLflow store for the module: creating a store costs seconds."""
    folder = tmp_path_factory.mktemp("names")
    return str(folder / "runs"), f"sqlite:///{folder / 'store.db'}"


def test_p4_reports_the_configured_rounds_and_its_resolved_default_defense(store):
    results_dir, uri = store
    text = io.StringIO()
    display = ProgressDisplay(Console(file=text, width=120))
    config = RunConfig(
        method="p4",
        clients=6,
        rounds=3,
        local_steps=1,
        seed=1,
        results_dir=results_dir,
        tracking_uri=uri,
    )
    summary = run(config, observers=[display]).summary
    assert summary["rounds"] == 3 and summary["rounds_completed"] == 3
    assert summary["phases"] == {
        "grouping": {"rounds": 1, "completed": 1},
        "cotraining": {"rounds": 3, "completed": 3},
    }
    assert _rounds_text(summary) == "3, after grouping (1 round)"
    assert (
        "3/3" in text.getvalue() and "4/4" not in text.getvalue()
    )  # the bar counts the configured rounds
    logged = MlflowClient(tracking_uri=uri).get_run(summary["run_id"])
    assert (
        logged.data.params["defense"] == "p4-secure" and logged.data.tags["defense"] == "p4-secure"
    )
    assert logged.info.run_name == "p4-none-p4-secure-digits-1"
    # MLflow's curves: co-training rounds 1..3 as any method's rounds, the grouping round at 0 before them
    history = MlflowClient(tracking_uri=uri).get_metric_history(summary["run_id"], "accuracy_mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    # the printed summary shows every figure the run reports: the proxy's accuracy, bytes and time per phase
    printed = io.StringIO()
    print_summary(Console(file=printed, width=200), summary)
    lines = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in printed.getvalue().splitlines()
        if line.count("│") == 3
    }
    assert lines["proxy accuracy mean"] == f"{summary['accuracy_proxy_mean']:.4f}"
    assert "grouping" in lines["bytes sent"] and "per client" in lines["bytes sent"]
    assert "grouping" in lines["time per phase"] and "cotraining" in lines["time per phase"]
    assert "replace-one" in lines["epsilon"] and "delta" in lines["epsilon"]


def test_attacked_and_clean_runs_are_named_apart(store):
    results_dir, uri = store
    config = RunConfig(
        method="fedavg",
        attack="label-flip",
        defense="median",
        clients=6,
        rounds=1,
        local_steps=1,
        seed=2,
        results_dir=results_dir,
        tracking_uri=uri,
    )
    summary = run(config).summary
    logged = MlflowClient(tracking_uri=uri).get_run(summary["run_id"])
    assert (
        logged.info.run_name == "fedavg-label-flip-median-digits-2"
        and logged.data.params["defense"] == "median"
    )
    assert run_name(config.replace(attack=None, defense=None), None) == "fedavg-none-none-digits-2"


def test_a_sweep_run_that_fails_is_named_with_its_resolved_defense(store):
    results_dir, uri = store
    config = RunConfig(
        method="p4",
        clients=6,
        rounds=1,
        results_dir=results_dir,
        tracking_uri=uri,
        options={"group_size": 99},
    )
    record = execute_task(RunTask(config.to_dict(), {"sweep": "names"}))
    assert record.status == "failed"
    logged = MlflowClient(tracking_uri=uri).get_run(record.mlflow_run_id)
    assert (
        logged.info.run_name == "p4-none-p4-secure-digits-0"
        and logged.data.params["defense"] == "p4-secure"
    )


def test_display_rounds_put_earlier_phases_before_the_last_phases_first_round():
    from types import SimpleNamespace

    from p4bench.records import display_round

    phases = [
        SimpleNamespace(name="setup", rounds=2),
        SimpleNamespace(name="grouping", rounds=1),
        SimpleNamespace(name="train", rounds=3),
    ]
    shown = [display_round(phases, p.name, r) for p in phases for r in range(p.rounds)]
    assert shown == [-2, -1, 0, 1, 2, 3]
    assert [
        display_round([SimpleNamespace(name="train", rounds=2)], "train", r) for r in range(2)
    ] == [1, 2]


def test_the_accuracy_plot_shows_the_rounds_mlflow_shows(tmp_path, monkeypatch):
    """accuracy.png's x values are `display_round`'s: P4's grouping at 0, co-training 1..T."""
    import matplotlib.axes

    from p4bench.run.artifacts import plot_accuracy

    (tmp_path / "metrics.csv").write_text(
        "step,phase,round,accuracy_mean,train_loss,seconds,bytes_sent\n"
        "1,grouping,0,0.1,1,0.1,1\n2,cotraining,0,0.3,1,0.1,1\n3,cotraining,1,0.4,1,0.1,1\n"
    )
    plotted = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, x, *a, **k: (plotted.append(list(x)), original(self, x, *a, **k))[1],
    )
    plot_accuracy(tmp_path / "metrics.csv", tmp_path / "accuracy.png", "t")
    assert plotted[0] == [0, 1, 2] and (tmp_path / "accuracy.png").exists()
