"""`p4bench compare` on an MLflow store written with known numbers (no training)."""

from __future__ import annotations

import csv
import io
import statistics

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.errors import UsageError
from p4bench.studies.compare import compare_experiment, default_group_by, format_table, plot_comparison

# (method, similarity, seed, final accuracy); each run also logs a 3-round curve ending there
RUNS = [
    ("p4", "0.25", 0, 0.60), ("p4", "0.25", 1, 0.64), ("p4", "0.25", 2, 0.62),
    ("p4", "0.5", 0, 0.70), ("p4", "0.5", 1, 0.72),
    ("local", "0.25", 0, 0.50), ("local", "0.25", 1, 0.40),
    ("local", "0.5", 0, 0.55),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("known")
    clock = iter(range(1_000_000, 2_000_000, 1000))  # distinct start times: the latest run of a config wins

    def log(method, similarity, seed, final, status="FINISHED", config_hash=None):
        tags = {"method": method, "attack": "none", "defense": "none", "dataset": "digits", "seed": str(seed),
                "config_hash": config_hash or f"{method}-{similarity}-{seed}"}
        run_id = client.create_run(experiment, start_time=next(clock), tags=tags).info.run_id
        params = {"method": method, "similarity": similarity, "seed": str(seed), "rounds": "3", "results_dir": f"/r{seed}"}
        curve = [final / 3, final / 2, final]
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric("accuracy_mean", v, 0, step) for step, v in enumerate(curve, 1)]
                         + [Metric("final_accuracy_mean", final, 0, 0)])
        client.set_terminated(run_id, status)

    log("local", "0.5", 0, 0.10)  # superseded by the next run of the same config
    for row in RUNS:
        log(*row)
    log("p4", "0.5", 2, 0.0, status="FAILED")  # failed runs are not compared
    return uri


def _expected(method, similarity):
    values = [acc for m, s, _, acc in RUNS if (m, s) == (method, similarity)]
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan")), len(values)


def test_groups_aggregate_over_seeds_with_duplicates_and_failures_left_out(store):
    comparison = compare_experiment(store, "known")
    assert comparison.group_by == ["method", "similarity"]  # what varies; never the seed or paths
    table = comparison.table
    assert len(table) == 4
    for row in table.to_dict("records"):
        mean, std, n = _expected(row["method"], row["similarity"])
        assert row["mean"] == pytest.approx(mean) and row["n"] == n
        assert (row["std"] != row["std"]) if n == 1 else row["std"] == pytest.approx(std)
    assert list(zip(table["method"], table["similarity"])) == [("local", "0.25"), ("local", "0.5"), ("p4", "0.25"),
                                                               ("p4", "0.5")]


def test_group_by_and_metric_choices(store):
    by_method = compare_experiment(store, "known", ["method"]).table.set_index("method")
    assert by_method.loc["p4", "n"] == 5 and by_method.loc["local", "n"] == 3
    assert compare_experiment(store, "known", ["method"], metric="accuracy_mean").table["n"].sum() == 8
    with pytest.raises(UsageError, match="unknown group key 'colour'.*similarity"):
        compare_experiment(store, "known", ["colour"])
    with pytest.raises(UsageError, match="metric 'loss'.*final_accuracy_mean"):
        compare_experiment(store, "known", metric="loss")
    with pytest.raises(UsageError, match="no MLflow experiment"):
        compare_experiment(store, "absent")


def test_markdown_csv_and_plot(store, tmp_path):
    comparison = compare_experiment(store, "known")
    markdown = format_table(comparison, "markdown").splitlines()
    assert markdown[0] == "| method | similarity | final_accuracy_mean mean | std | n |" and len(markdown) == 6
    rows = list(csv.DictReader(io.StringIO(format_table(comparison, "csv"))))
    assert [r["n"] for r in rows] == ["2", "1", "3", "2"]
    out = plot_comparison(comparison, tmp_path / "plots" / "cmp.png")
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_default_group_by_falls_back_to_method():
    import pandas as pd

    frame = pd.DataFrame({"method": ["p4", "p4"], "params.seed": ["0", "1"], "params.rounds": ["3", "3"]})
    assert default_group_by(frame) == ["method"]


def test_cli_table_and_plot(store, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--experiment", "known", "--tracking-uri", store, "--format", "markdown",
              "--plot", str(tmp_path / "c.png")])
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "| p4 | 0.25 | 0.6200 | 0.0200 | 3 |" in out
    assert (tmp_path / "c.png").exists() and "plot written" in err
    with pytest.raises(SystemExit) as info:
        main(["compare", "--experiment", "known", "--tracking-uri", store, "--format", "xml"])
    assert info.value.code == 2


def test_numbers_sort_numerically_and_before_text():
    import pandas as pd

    from p4bench.studies.compare import aggregate

    runs = pd.DataFrame({"params.epsilon": ["15.0", "none", "3.0", "3.0"],
                         "metrics.final_accuracy_mean": [0.7, 0.5, 0.6, 0.4]})
    table = aggregate(runs, ["epsilon"])
    assert list(table["epsilon"]) == ["3.0", "15.0", "none"] and list(table["n"]) == [2, 1, 1]
    assert table["mean"].iloc[0] == pytest.approx(0.5)


def test_private_runs_add_epsilon_over_rounds_and_accuracy_against_epsilon(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    uri = f"sqlite:///{tmp_path / 'private.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("private")
    for method, final in (("p4", 0.7), ("fedavg", 0.6)):
        tags = {"method": method, "attack": "none", "defense": "none", "dataset": "digits", "seed": "0",
                "config_hash": method}
        run_id = client.create_run(experiment, tags=tags).info.run_id
        metrics = [Metric("accuracy_mean", final * step / 3, 0, step) for step in (1, 2, 3)]
        metrics += [Metric("epsilon_max", 8.0 * step / 3, 0, step) for step in (1, 2, 3)]
        client.log_batch(run_id, params=[Param("method", method), Param("seed", "0")],
                         metrics=metrics + [Metric("final_accuracy_mean", final, 0, 0)])
        client.set_terminated(run_id, "FINISHED")
    figures = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1])
    plot_comparison(compare_experiment(uri, "private"), tmp_path / "cmp.png")
    axes = figures[0].axes
    assert len(axes) == 4 and axes[2].get_ylabel().startswith("epsilon spent")
    assert axes[3].get_xlabel().startswith("epsilon at the end")
    points = [container.lines[0] for container in axes[3].containers]  # one errorbar per group
    assert sorted(float(p.get_ydata()[0]) for p in points) == pytest.approx([0.6, 0.7])
    assert [float(p.get_xdata()[0]) for p in points] == pytest.approx([8.0, 8.0])
