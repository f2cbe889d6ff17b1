"""Where results are seen (`p4bench.tracking.links`): a run and a sweep end with the MLflow
runs table's link (a saved view whose columns are method, attack, defense, accuracy and
epsilon), the `mlflow ui` command of a local store and the compare command beside it; a named
tracking server that does not answer stops `run` and `sweep` before anything is trained."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.run.runner import run
from p4bench.tracking.links import (
    RUNS_VIEW_COLUMNS,
    RUNS_VIEW_KEY,
    RUNS_VIEW_TAG,
    compare_command,
    runs_view_tag,
    where_to_look,
)

SMALL = ["--method", "fedavg", "--clients", "4", "--rounds", "1", "--verify", "off"]


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def free_port() -> int:
    """A port nothing listens on (bound, never listened, closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def decode_view(value: str) -> dict:
    """The saved view as MLflow's runs page reads it (savedViewEnvelope: `name` a string,
    `createdAt` a number, `state` a string holding JSON, deflated only under `deflate;`)."""
    envelope = json.loads(value)
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    assert isinstance(envelope["state"], str) and not envelope["state"].startswith("deflate;")
    return json.loads(envelope["state"])


def shown_columns(view: dict) -> list[tuple[str, str]]:
    """(kind, key) of each column the view selects (MLflow's `kind.\\`key\\`` ids)."""
    found = [re.fullmatch(r"(params|metrics|tags)\.`(.+)`", c) for c in view["selectedColumns"]]
    assert all(found), view
    return [(m.group(1), m.group(2)) for m in found if m]


def test_the_saved_view_selects_the_five_fields_in_a_tag_mlflow_accepts():
    key, value = runs_view_tag(1)
    assert key == f"mlflow.sharedViewState.{RUNS_VIEW_KEY}" == RUNS_VIEW_TAG
    assert len(value) <= 20000  # MLflow's limit on an experiment tag (and the UI's on a view)
    columns = shown_columns(decode_view(value))
    assert columns == list(RUNS_VIEW_COLUMNS)
    keys = {k for _, k in columns}
    assert {"method", "attack", "defense", "final_accuracy_mean", "epsilon"} <= keys


def test_the_installed_mlflow_ui_opens_a_saved_view_by_its_link():
    """The contract the link relies on, read from the installed UI's own code: views are
    experiment tags `mlflow.sharedViewState.<id>` in a JSON envelope, opened by
    `?viewStateShareKey=<id>`. An MLflow that drops them fails here, not in a user's browser."""
    import mlflow

    build = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    if not build.is_dir():
        pytest.skip("this MLflow has no UI build (mlflow-skinny)")
    code = "\n".join(p.read_text(errors="replace") for p in build.glob("*.js"))
    for needle in (
        '"mlflow.sharedViewState."',
        '"viewStateShareKey"',
        "Invalid saved-view envelope",
        "selectedColumns",
    ):
        assert needle in code, needle


def test_a_run_ends_with_the_runs_table_link_and_the_compare_command(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # compare, run from here, would not find this store by itself
    results = tmp_path / "elsewhere"
    code, out, err = invoke(
        ["run", *SMALL, "--epsilon", "8", "--results-dir", str(results), "--experiment", "links"],
        capsys,
    )
    assert code == 0, err
    uri = "sqlite:///" + str((results / "mlflow.db").resolve())
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("links")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    table = f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs"
    lines = out.splitlines()
    assert f"MLflow runs table: {table}?viewStateShareKey={RUNS_VIEW_KEY}" in lines
    assert f"  this run: {table}/{mlrun.info.run_id}" in lines
    assert any(
        line.startswith("  start the UI first: ") and line.endswith(f"ui --backend-store-uri {uri}")
        for line in lines
    )
    assert any(
        line.endswith(
            "as a table: p4bench compare --experiment links "
            f"--group-by method,attack,defense,epsilon --tracking-uri {uri}"
        )
        for line in lines
    )
    # the view the link opens, and every one of its columns this private run logged
    view = decode_view(experiment.tags[RUNS_VIEW_TAG])
    data = mlrun.data
    logged = {"params": data.params, "metrics": data.metrics, "tags": data.tags}
    missing = [
        (kind, key)
        for kind, key in shown_columns(view)
        if key not in logged[kind] and key != "final_accuracy_global_mean"  # --eval global only
    ]
    assert missing == []
    assert (data.params["method"], data.params["attack"], data.params["defense"]) == (
        "fedavg",
        "none",
        "none",
    )
    assert data.metrics["epsilon"] > 0 and 0 <= data.metrics["final_accuracy_mean"] <= 1


def test_the_view_is_written_once_and_a_changed_one_kept(tmp_path):
    from p4bench.tracking.ops import MlflowOps

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    ops = MlflowOps(uri)
    ops.start_run("kept", {}, "first", {}, None)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("kept")
    assert decode_view(experiment.tags[RUNS_VIEW_TAG])["selectedColumns"]
    client.set_experiment_tag(experiment.experiment_id, RUNS_VIEW_TAG, "changed in the UI")
    ops.start_run("kept", {}, "second", {}, None)
    assert client.get_experiment_by_name("kept").tags[RUNS_VIEW_TAG] == "changed in the UI"


def test_compare_needs_no_store_option_for_the_default_store(monkeypatch, tmp_path):
    from p4bench.studies.results import tracking_uri_for

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = tracking_uri_for(None, "p4bench-runs")
    keys = "--group-by method,attack,defense,epsilon"
    assert compare_command("grid", default) == f"p4bench compare --experiment grid {keys}"
    assert compare_command("my grid", "http://h:5000") == (
        f"p4bench compare --experiment 'my grid' {keys} --tracking-uri http://h:5000"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://h:5000")
    assert compare_command("grid", "http://h:5000") == f"p4bench compare --experiment grid {keys}"


def test_nothing_is_printed_for_what_the_store_does_not_hold(tmp_path):
    assert where_to_look(f"sqlite:///{tmp_path / 'none.db'}", experiment="x") == []
    assert where_to_look(f"http://127.0.0.1:{free_port()}", run_id="abc") == []
    assert where_to_look("postgresql://db/mlflow", experiment="x") == []


# -- an unreachable server -----------------------------------------------------------------------


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_run_whose_named_server_does_not_answer_exits_2_before_training(
    capsys, monkeypatch, tmp_path
):
    uri = f"http://127.0.0.1:{free_port()}"
    results = tmp_path / "runs"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, out, err = invoke(["run", *SMALL, "--results-dir", str(results)], capsys)
    line = one_error_line(err)
    assert code == 2 and uri in line and "unset MLFLOW_TRACKING_URI" in line
    assert f"sqlite:///{results.resolve()}/mlflow.db" in line  # where runs go without it
    assert not results.exists() and "rounds" not in out  # nothing was run
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    code, _, err = invoke(
        ["run", *SMALL, "--results-dir", str(results), "--tracking-uri", uri], capsys
    )
    line = one_error_line(err)
    assert code == 2 and "leave out --tracking-uri" in line and not results.exists()


def test_a_sweep_whose_named_server_does_not_answer_exits_2(capsys, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        "name: tiny\nbase: {dataset: digits, clients: 4, rounds: 1}\naxes: {method: [local]}\n"
    )
    results = tmp_path / "runs"
    code, _, err = invoke(
        ["sweep", str(spec), "--tracking-uri", uri, "--results-dir", str(results)], capsys
    )
    line = one_error_line(err)
    assert code == 2 and uri in line and "nothing was run" in line and not results.exists()


# -- a tracking server: what the runs page reads -------------------------------------------------

SERVER = """
import os, sys
os.environ["_MLFLOW_SERVER_FILE_STORE"] = sys.argv[1]
os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = sys.argv[2]
from mlflow.server import app
from werkzeug.serving import make_server
server = make_server("127.0.0.1", 0, app, threaded=True)
print(server.server_port, flush=True)
server.serve_forever()
"""


@pytest.fixture
def mlflow_server(tmp_path):
    """MLflow's tracking server (its Flask app) on 127.0.0.1 over a SQLite store in tmp."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, f"sqlite:///{tmp_path / 'served.db'}", str(tmp_path / "a")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=600)  # bounded: a server that never starts fails the test
    try:
        assert port and port[0].strip().isdigit(), "the MLflow server did not start"
        yield f"http://127.0.0.1:{port[0].strip()}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def test_a_servers_runs_page_gets_the_view_and_the_five_fields_of_each_run(
    mlflow_server, small_config, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    summaries = [
        run(
            small_config(
                method=method, rounds=1, tracking_uri=mlflow_server, experiment="served", **extra
            )
        ).summary
        for method, extra in (("fedavg", {"epsilon": 8.0}), ("local", {}))
    ]
    assert all(s["tracked"] for s in summaries), [s["tracking_error"] for s in summaries]
    # the experiment as the page fetches it: the view's tag beside the runs-table kind
    got = get(f"{mlflow_server}/ajax-api/2.0/mlflow/experiments/get-by-name?experiment_name=served")
    experiment = got["experiment"]
    tags = {t["key"]: t["value"] for t in experiment["tags"]}
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    columns = shown_columns(decode_view(tags[RUNS_VIEW_TAG]))
    # the runs as the table fetches them: every row carries method, attack, defense, accuracy
    found = get(
        f"{mlflow_server}/ajax-api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment["experiment_id"]]},
    )["runs"]
    rows = {}
    for row in found:
        data = row["data"]
        values = {
            kind: {x["key"]: x["value"] for x in data.get(kind, [])}
            for kind in ("params", "metrics", "tags")
        }
        rows[values["params"]["method"]] = {
            (kind, key): values[kind].get(key) for kind, key in columns
        }
    assert set(rows) == {"fedavg", "local"}
    for row in rows.values():
        assert row[("params", "attack")] == "none" and row[("params", "defense")] == "none"
        assert 0 <= row[("metrics", "final_accuracy_mean")] <= 1
        assert row[("tags", "dp.certified")] in ("true", "false")
    assert rows["fedavg"][("metrics", "epsilon")] > 0
    assert rows["local"][("metrics", "epsilon")] is None  # a non-private run logs none, not 0
    # the printed lines name this server's page, and no `mlflow ui` to start
    run_id = summaries[0]["run_id"]
    lines = where_to_look(mlflow_server, run_id=run_id)
    table = f"{mlflow_server}/#/experiments/{experiment['experiment_id']}/runs"
    assert lines[0] == f"MLflow runs table: {table}?viewStateShareKey={RUNS_VIEW_KEY}"
    assert lines[1] == f"  this run: {table}/{run_id}"
    assert not any("mlflow ui" in line for line in lines)
    assert where_to_look(mlflow_server, experiment="served")[0] == lines[0]
    assert os.environ.get("MLFLOW_TRACKING_URI") is None
