"""The tracking worker (`p4bench run`'s MLflow writer in a second process) records what the
tracker in the run's own process records, keeps the first failure as one line, survives
Ctrl-C, and is not left behind by a run that fails before it starts."""

from __future__ import annotations

import io
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from p4bench.run.runner import run
from p4bench.tracking import worker as tracking_worker
from p4bench.tracking.worker import WorkerBackend, serve


def _run_record(uri: str, run_id: str) -> dict[str, object]:
    """What MLflow holds of a run, without ids and times."""
    client = MlflowClient(tracking_uri=uri)
    held = client.get_run(run_id)
    varying = {"local_run_id", "results_dir", "mlflow.runName", "git_commit"}
    metrics = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in held.data.metrics
        if key not in ("wall_time_s", "round_seconds")
    }
    return {
        "status": held.info.status,
        "params": {
            k: v for k, v in held.data.params.items() if k not in ("results_dir", "tracking_uri")
        },
        "tags": {
            k: v
            for k, v in held.data.tags.items()
            if k not in varying and not k.startswith("mlflow.user")
        },
        "metrics": metrics,
        "artifacts": sorted(a.path for a in client.list_artifacts(run_id)),
        "dataset": [
            (d.dataset.name, d.dataset.digest, d.dataset.profile)
            for d in held.inputs.dataset_inputs
        ],
    }


def test_worker_records_what_the_run_process_records(small_config, tmp_path, monkeypatch):
    records = []
    for label, prestarted in (("local", False), ("worker", True)):
        uri = f"sqlite:///{tmp_path / label / 'mlflow.db'}"
        (tmp_path / label).mkdir()
        config = small_config(
            method="fedavg", tracking_uri=uri, results_dir=str(tmp_path / label), experiment="e"
        )
        tracking_worker.prestart(enabled=prestarted)
        worker = tracking_worker._prestarted
        assert (worker is not None) == prestarted
        summary = run(config).summary
        assert tracking_worker._prestarted is None  # the tracker took it
        if worker is not None:
            assert worker.process.poll() == 0  # closed at the run's end, after writing everything
        assert summary["tracked"], summary["tracking_error"]
        records.append(_run_record(uri, summary["run_id"]))
    local, remote = records
    assert local["metrics"]["accuracy_mean"] and local["artifacts"]
    assert remote == local


def _serve(requests: list[tuple]) -> list[tuple]:
    stream = io.BytesIO()
    for request in requests:
        pickle.dump(request, stream)
    stream.seek(0)
    answers = io.BytesIO()
    serve(stream, answers)
    answers.seek(0)
    out = []
    while answers.tell() < len(answers.getvalue()):
        out.append(pickle.load(answers))
    return out


def test_a_store_that_cannot_be_opened_is_one_line_and_later_requests_are_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    uri = f"sqlite:///{blocker / 'store.db'}"  # its folder is a file: SQLite cannot create it
    answers = _serve(
        [
            ("open", uri, {}),
            ("ask", "create run", "start_run", ("e", {}, "r", {}, None)),
            ("call", "log metrics", "log_metrics", ([("m", 1.0, 0, 1)],)),
            ("close",),
        ]
    )
    (created, error), (closing_value, closing_error) = answers
    assert (
        created is None
        and error.startswith(f"MLflow store {uri} cannot be opened (")
        and "\n" not in error
    )
    assert closing_value is None and closing_error == error


def test_the_first_failure_is_kept_and_ends_the_writes(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    answers = _serve(
        [
            ("open", uri, {}),
            ("ask", "create run", "start_run", ("e", {}, "r", {}, None)),
            (
                "call",
                "tag run",
                "set_tags",
                ({"x" * 300: "v"},),
            ),  # MLflow refuses a 300-character key
            ("call", "log metrics", "log_metrics", ([("m", 1.0, 0, 1)],)),
            ("close",),
        ]
    )
    (run_id, none), (_, error) = answers
    assert none is None and run_id
    assert error.startswith("MLflow tag run failed (")
    assert (
        MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics == {}
    )  # nothing written after the failure


def test_worker_ignores_ctrl_c_and_a_lost_worker_is_one_line(tmp_path):
    worker = WorkerBackend()
    try:
        worker.open(f"sqlite:///{tmp_path / 'store.db'}")
        reply = worker.ask("create run", "start_run", "e", {}, "r", {}, None)
        assert reply.value()
        worker.process.send_signal(
            signal.SIGINT
        )  # the run's handler still marks the MLflow run KILLED through it
        assert (
            worker.ask("tag run", "set_tags", {"after": "ctrl-c"}).value() is None
            and worker.process.poll() is None
        )
        assert worker.error is None
        worker.process.kill()
        worker.process.wait(timeout=30)
        late = worker.ask("log metrics", "log_metrics", [("m", 1.0, 0, 1)])
        assert late.value() is None
        error = worker.close()
        assert error is not None and error.startswith("MLflow tracking worker ended unexpectedly")
    finally:
        worker.process.kill()


@pytest.mark.parametrize(
    ("arguments", "workers"),
    [
        # a plugin option is checked once the plugins are loaded: the worker is up by then
        (["--method", "fedavg", "-o", "no_such_option=1"], "1"),
        # a name the plugin listing does not know is refused before anything starts
        (["--method", "no-such-method"], "0"),
    ],
)
def test_a_run_that_fails_before_it_starts_leaves_no_worker(tmp_path, arguments, workers):
    """The console script's `run` prestarts the worker; a bad option ends both processes."""
    script = Path(sys.executable).parent / "p4bench"
    if not script.exists():
        pytest.skip("no p4bench console script beside this interpreter")
    code = (
        "import subprocess, sys\n"
        "children = []\n"
        "real = subprocess.Popen\n"
        "def spy(*args, **kwargs):\n"
        "    child = real(*args, **kwargs)\n"
        "    children.append(child)\n"
        "    return child\n"
        "subprocess.Popen = spy\n"
        "from p4bench.cli import main\n"
        "sys.argv = ['p4bench', 'run', *sys.argv[2:], '--results-dir', sys.argv[1]]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "workers = [c for c in children if 'p4bench.tracking.worker' in c.args]\n"
        "print(code, len(workers), [w.wait(timeout=600) for w in workers])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, tracking_worker.ENV: ""},
    )
    assert done.stdout.split()[:2] == ["2", workers], done.stderr  # exit 2, the workers started
    expected_end = "[0]" if workers == "1" else "[]"  # ... and ended cleanly when refused
    assert done.stdout.strip().endswith(expected_end)


def test_store_written_by_the_worker_is_a_plain_mlflow_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    answers = _serve(
        [
            ("open", uri, {}),
            ("ask", "create run", "start_run", ("e", {"method": "m"}, "r", {"p": "1"}, None)),
            ("call", "finish run", "terminate", ("FINISHED",)),
            ("close",),
        ]
    )
    (run_id, _), _ = answers
    with sqlite3.connect(tmp_path / "store.db") as db:
        assert db.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() == (
            "FINISHED",
        )


def test_a_worker_without_mlflow_says_so_in_one_line(tmp_path):
    """Where MLflow cannot be imported (a GPU image without it), the worker stays up and the
    run is told why it was not tracked, not that the worker ended (a broken pipe)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    requests = io.BytesIO()
    for request in [
        ("open", uri, {}),
        ("ask", "create run", "start_run", ("e", {}, "r", {}, None)),
        ("close",),
    ]:
        pickle.dump(request, requests)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['mlflow'] = None\n"
            "from p4bench.tracking import worker; worker._main()",
        ],
        input=requests.getvalue(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answers = io.BytesIO(done.stdout)
    (created, error), (_, closing_error) = pickle.load(answers), pickle.load(answers)
    assert created is None and closing_error == error
    assert error.startswith(f"MLflow store {uri} cannot be opened (ModuleNotFoundError")
    assert "mlflow" in error and "\n" not in error
