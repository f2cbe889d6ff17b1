"""`p4bench tune`: grid search on evaluation clients only; reported clients' test data is never read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import p4bench.data.pipeline
import p4bench.engine.held_clients
import p4bench.run.runner
from p4bench.cli import main
from p4bench.errors import UsageError
from p4bench.studies.backends import RunTask, execute_task
from p4bench.studies.sweep import load_sweep
from p4bench.studies.tune import TuneSpec, parse_tune, plan_tuning, run_tuning

TINY = {"dataset": "digits", "clients": 8, "rounds": 2, "local_steps": 2, "seed": 0}
SENTINEL = 12345.0


def _corrupting(which: str):
    """A build_federated_data that overwrites the test split of the `which` clients
    ("reported": every non-evaluation client, "evaluation": the others) with a sentinel
    and shifted labels."""
    original = p4bench.data.pipeline.build_federated_data

    def build(dataset, partition, eval_fraction, rng):
        data = original(dataset, partition, eval_fraction, rng)
        rows = ~data.evaluation if which == "reported" else data.evaluation
        data.test.x[rows] = SENTINEL
        data.test.y[rows] = (data.test.y[rows] + 1) % data.num_classes
        return data

    return build


def test_tuning_runs_never_evaluate_on_reported_clients_test_data(small_config, monkeypatch):
    """The reported clients' test samples are replaced by a sentinel; in a tuning run no
    evaluation ever sees it (their splits are withheld), in an ordinary run it does."""
    monkeypatch.setattr(p4bench.data.pipeline, "build_federated_data", _corrupting("reported"))
    seen: list[torch.Tensor] = []
    original = p4bench.engine.held_clients.accuracy

    def spy(model, params, x, y, n):
        seen.append(x[torch.arange(x.shape[1]) < n.unsqueeze(1)])  # the samples it may read
        return original(model, params, x, y, n)

    monkeypatch.setattr(p4bench.engine.held_clients, "accuracy", spy)
    config = small_config(method="p4", rounds=2)
    tuning = execute_task(RunTask(config.to_dict(), tuning=True, track=False))
    assert tuning.status == "finished" and seen
    assert not any(bool((x == SENTINEL).any()) for x in seen)
    assert (
        math.isnan(tuning.summary["accuracy_mean"]) and tuning.summary["accuracy_per_client"] == {}
    )
    assert all(math.isnan(r["accuracy_mean"]) for r in tuning.rounds)
    assert 0 < tuning.evaluation_accuracy <= 1
    seen.clear()
    ordinary = execute_task(RunTask(config.to_dict(), track=False))
    assert any(bool((x == SENTINEL).any()) for x in seen)  # the spy does catch it when it is read
    # evaluation clients' accuracy is the same either way: withholding changes nothing else
    assert ordinary.evaluation_accuracy == tuning.evaluation_accuracy


def test_selection_depends_on_evaluation_clients_only(monkeypatch, tmp_path):
    spec = TuneSpec(
        "t", {**TINY, "results_dir": str(tmp_path)}, {"fedavg": {"lr": (0.05, 0.5, 2.0)}}, (0,)
    )

    def scores():
        result = run_tuning(spec, track=False)
        return [p.mean for p in result.points["fedavg"]], result.best["fedavg"]

    clean, best = scores()
    assert all(0 <= s <= 1 for s in clean) and best == {
        "lr": [0.05, 0.5, 2.0][int(np.argmax(clean))]
    }
    monkeypatch.setattr(p4bench.data.pipeline, "build_federated_data", _corrupting("reported"))
    assert scores() == (clean, best)  # reported clients' test data cannot move the selection
    monkeypatch.setattr(p4bench.data.pipeline, "build_federated_data", _corrupting("evaluation"))
    assert scores()[0] != clean  # while the evaluation clients' test data does


def test_tuning_file_and_plan():
    spec = parse_tune(
        {
            "name": "tune-x",
            "base": TINY,
            "seeds": [0, 1],
            "grid": {"lr": [0.1, 1.0]},
            "methods": {"fedavg": None, "p4": {"local_steps": [1, 3]}},
        }
    )
    planned = plan_tuning(spec)
    assert [m for m, _ in planned].count("fedavg") == 2 * 2 and [m for m, _ in planned].count(
        "p4"
    ) == 2 * 2 * 2
    assert {run.tags["tune_point"] for m, run in planned if m == "p4"} == {
        f"lr={lr} local_steps={k}" for lr in (0.1, 1.0) for k in (1, 3)
    }
    with pytest.raises(UsageError, match="evaluation clients"):
        plan_tuning(
            parse_tune(
                {"base": {**TINY, "eval_fraction": 0}, "grid": {"lr": [1]}, "methods": ["fedavg"]}
            )
        )
    with pytest.raises(UsageError, match="cannot be tuned"):
        parse_tune({"grid": {"seed": [0, 1]}, "methods": ["fedavg"]})
    with pytest.raises(UsageError, match="methods"):
        parse_tune({"grid": {"lr": [1]}})


def test_cli_picks_a_learning_rate_for_fedavg_and_p4_and_resumes(
    verify_full, tmp_path, capsys, monkeypatch
):
    results, output = str(tmp_path / "runs"), tmp_path / "tuned.yaml"
    args = [
        "tune",
        "--method",
        "fedavg",
        "--method",
        "p4",
        "--grid",
        "lr=0.05,0.5,2.0",
        "--seeds",
        "0",
        "--set",
        "clients=8",
        "--set",
        "rounds=2",
        "--set",
        "local_steps=2",
        "--results-dir",
        results,
        "--output",
        str(output),
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    document = yaml.safe_load(output.read_text())
    for method in ("fedavg", "p4"):
        scores = document["scores"][method]
        assert [s["lr"] for s in scores] == [0.05, 0.5, 2.0] and all(s["n"] == 1 for s in scores)
        best = max(scores, key=lambda s: s["mean"])
        assert document["tuned"][method] == {"lr": best["lr"]}
    assert document["selection"]["metric"] == "accuracy_evaluation_mean"
    client = MlflowClient(tracking_uri=f"sqlite:///{results}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tune-digits").experiment_id])
    assert len(runs) == 6 and all(r.data.tags["tuning"] == "true" for r in runs)
    assert all(
        "accuracy_evaluation_mean" in r.data.metrics and "final_accuracy_mean" not in r.data.metrics
        for r in runs
    )
    # a sweep can include the result
    (tmp_path / "sweep.yaml").write_text(
        "name: s\ninclude: tuned.yaml\naxes: {method: [fedavg, p4]}\n"
    )
    assert load_sweep(tmp_path / "sweep.yaml").per_method == document["tuned"]
    # tuning again trains nothing and chooses the same from the stored evaluation accuracies
    monkeypatch.setattr(
        p4bench.run.runner,
        "run",
        lambda *a, **k: pytest.fail("a finished tuning run was trained again"),
    )
    output.unlink()
    with pytest.raises(SystemExit) as info:
        main(args)
    assert (info.value.code or 0) == 0
    assert yaml.safe_load(output.read_text())["tuned"] == document["tuned"]


def test_tuning_runs_report_no_figures_of_withheld_clients_per_round():
    """A withheld client's empty test split scores 0; a tuning run reports NaN instead, in
    every round's per-client values too, so no participation curve of zeros is written."""
    from types import SimpleNamespace

    from p4bench.records import RoundReport
    from p4bench.studies.backends import WithheldTests
    from p4bench.tracking.participation import participation_curve

    withheld = WithheldTests()
    withheld.withheld = np.array([True, True, False])
    reports = []
    for step in (1, 2):
        report = RoundReport(
            "train",
            step - 1,
            step,
            np.array([0.0, 0.0, 0.8]),
            0.1,
            1.0,
            0,
            extra_accuracy={
                "count_synergies": np.array([step, step, step], dtype=float),
                "test_loss": np.array([0.0, 0.0, 0.5]),
            },
        )
        withheld.round_finished(SimpleNamespace(), report)
        reports.append(report)
    assert np.isnan(reports[0].accuracy[:2]).all() and reports[0].accuracy[2] == 0.8
    assert np.isnan(reports[0].extra_accuracy["test_loss"][:2]).all()
    assert reports[1].extra_accuracy["count_synergies"].tolist() == [
        2,
        2,
        2,
    ]  # counts are not test figures
    assert (
        participation_curve(reports, np.array([True, True, False])) == []
    )  # only withheld peers: no curve
    assert participation_curve(reports, np.array([True, True, True]))[0][
        "accuracy"
    ] == pytest.approx(0.8)
