"""MLflow tracking against a real SQLite store, and the local copy when MLflow is down."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from mlflow.tracking import MlflowClient

from p4bench.run.runner import run


def test_mlflow_run_holds_params_metrics_tags_and_artifacts(small_config, tmp_path):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    result = run(small_config(method="fedavg", tracking_uri=uri, experiment="tracking-test"))
    summary = result.summary
    assert summary["tracked"] and summary["tracking_uri"] == uri
    client = MlflowClient(tracking_uri=uri)
    mlrun = client.get_run(summary["run_id"])
    params, tags = mlrun.data.params, mlrun.data.tags
    assert params["method"] == "fedavg" and params["clients"] == "8" and params["rounds"] == "3"
    for key, value in {
        "method": "fedavg",
        "attack": "none",
        "defense": "none",
        "dataset": "digits",
        "seed": "1",
    }.items():
        assert tags[key] == value
    assert tags["p4bench_version"]
    history = client.get_metric_history(summary["run_id"], "accuracy_mean")
    assert [m.step for m in history] == [1, 2, 3]
    assert len(client.get_metric_history(summary["run_id"], "train_loss")) == 3
    names = {a.path for a in client.list_artifacts(summary["run_id"])}
    assert {"config.yaml", "clients.csv", "accuracy.png"} <= names
    assert mlrun.info.status == "FINISHED"
    # the runs table's Dataset column, and an experiment that opens on its runs (not MLflow 3's GenAI overview)
    (given,) = mlrun.inputs.dataset_inputs
    assert given.dataset.name == "digits" and "iid over 8 clients" in given.dataset.source
    assert json.loads(given.dataset.profile)["train_records"] > 0
    assert {t.key: t.value for t in given.tags}["mlflow.data.context"] == "training"
    assert (
        client.get_experiment(mlrun.info.experiment_id).tags["mlflow.experimentKind"]
        == "custom_model_development"
    )


def test_unreachable_tracking_server_keeps_results_locally(small_config):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run(small_config(tracking_uri=f"http://127.0.0.1:{port}"))
    summary = result.summary
    assert summary["tracked"] is False and "cannot be reached" in summary["tracking_error"]
    folder = Path(summary["results_dir"])
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["accuracy_mean"] == summary["accuracy_mean"]
    assert len((folder / "metrics.csv").read_text().splitlines()) == 1 + 3
    assert (folder / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
