"""Ctrl-C and `--resume`: an interrupted run continues from its checkpoint to exactly the
result of an uninterrupted run, in the same MLflow run; sweeps resume their runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.run import interrupts
from p4bench.run.checkpoint import CHECKPOINT_FILE, load
from p4bench.run.interrupts import RunInterrupted
from p4bench.run.runner import run
from p4bench.studies.sweep import SweepInterrupted, parse_sweep, run_sweep
from p4bench.testing.runs import StopAfterStep


@pytest.fixture(autouse=True)
def no_stop_left_over():
    interrupts.clear_stop()
    yield
    interrupts.clear_stop()


@pytest.fixture(autouse=True)
def sigint_not_ignored():
    """These tests are about Ctrl-C, which the commands handle only where SIGINT is not
    ignored: a test command started in the background (`cmd &` without job control)
    inherits an ignored SIGINT, and a sweep then rightly keeps no stop request between
    its runs. Run them as from a terminal, whatever started the test command."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_interrupted_p4_run_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """P4 (grouping phase, default DP and p4-secure defense): stopped in cotraining round 2,
    resumed through the CLI, it ends with the same per-client accuracies and epsilon; the
    MLflow run was KILLED, then goes on with continuous steps and finishes."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    config = RunConfig(
        method="p4",
        clients=6,
        rounds=4,
        local_steps=2,
        seed=1,
        results_dir=str(tmp_path / "runs"),
        tracking_uri=uri,
        experiment="resume",
    )
    full = run(config).summary

    with pytest.raises(RunInterrupted) as stopped:
        run(config, observers=[StopAfterStep(3)])  # step 1 is the grouping round
    folder = stopped.value.results_dir
    assert stopped.value.resumable and f"--resume {folder}" in stopped.value.line()
    assert "after round 2 of 4" in stopped.value.line()
    checkpoint = load(folder)
    assert checkpoint is not None and checkpoint.meta["step"] == 3
    torch.load(folder / CHECKPOINT_FILE, weights_only=True)  # plain tensors and containers only
    client = MlflowClient(tracking_uri=uri)
    mlflow_id = stopped.value.mlflow_run_id
    assert client.get_run(mlflow_id).info.status == "KILLED"

    code, out, err = invoke(["run", "--resume", str(folder), "--json"], capsys)
    assert code == 0, err
    resumed = json.loads(out.strip().splitlines()[-1])
    assert resumed["accuracy_per_client"] == full["accuracy_per_client"]
    assert resumed["epsilon"] == full["epsilon"] and resumed["resumed_from_step"] == 3
    assert resumed["run_id"] == mlflow_id and resumed["results_dir"] == str(folder)
    logged = client.get_run(mlflow_id)
    assert logged.info.status == "FINISHED"
    # MLflow shows the grouping round at 0 and co-training rounds 1..4 (`display_round`)
    assert [m.step for m in client.get_metric_history(mlflow_id, "accuracy_mean")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    rows = (folder / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4", "5"]
    assert not (folder / CHECKPOINT_FILE).exists()  # a finished run keeps no checkpoint

    code, out, err = invoke(["run", "--resume", str(folder)], capsys)  # finished: says so, exit 0
    assert code == 0 and "already finished" in err
    code, _, err = invoke(["run", "--resume", str(folder), "--rounds", "9"], capsys)
    assert code == 2 and "--rounds" in err


def test_first_ctrl_c_in_the_cli_says_where_the_results_are_and_how_to_resume(tmp_path, capsys):
    from p4bench.host.manager import default_plugin_manager

    stopper = StopAfterStep(2)
    default_plugin_manager().register(stopper)
    try:
        code, out, err = invoke(
            [
                "run",
                "--method",
                "local",
                "--clients",
                "4",
                "--rounds",
                "5",
                "--results-dir",
                str(tmp_path / "runs"),
            ],
            capsys,
        )
    finally:
        default_plugin_manager().unregister(stopper)
    (folder,) = (tmp_path / "runs").glob(f"*/{CHECKPOINT_FILE}")
    last = err.strip().splitlines()[-1]
    assert code == 130 and last.startswith("interrupted after round 2 of 5; results so far in ")
    assert last.endswith(f"resume with: p4bench run --resume {folder.parent}")
    assert not interrupts.stop_requested()  # the command's flag is gone with its handler


def test_interrupt_during_start_up_is_one_line(tmp_path, capsys, monkeypatch):
    import p4bench.run.runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(p4bench.run.runner, "prepare", interrupted)
    code, out, err = invoke(["run", "--method", "local", "--results-dir", str(tmp_path)], capsys)
    assert code == 130 and err.strip() == "interrupted during start-up; nothing was trained"


def _cli(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200"}
    command = [
        sys.executable,
        "-c",
        "from p4bench.cli import main; main()",
        "run",
        "--method",
        "fedavg",
        "--clients",
        "4",
        "--rounds",
        "300",
        "--results-dir",
        str(tmp_path / "runs"),
        *args,
    ]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as a terminal's job


def _first_checkpoint(tmp_path: Path, process: subprocess.Popen, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = list((tmp_path / "runs").glob(f"*/{CHECKPOINT_FILE}"))
        if found:
            return found[0].parent
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no checkpoint appeared: {process.communicate()[1][-2000:]}")


def test_ctrl_c_in_a_real_process_checkpoints_and_a_second_one_exits_at_once(tmp_path):
    """First Ctrl-C: the round ends, the run is KILLED in MLflow, one line says how to
    resume, exit 130. Second Ctrl-C during a round: out at once, exit 130, no traceback."""
    process = _cli(tmp_path, "--local-steps", "300")
    folder = _first_checkpoint(tmp_path, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.1)
    process.send_signal(signal.SIGINT)  # mid-round: the rounds take far longer than this
    _, err = process.communicate(
        timeout=600
    )  # a bound, not a measurement: "at once" is the message below
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.splitlines()[-1]
    assert (
        last.startswith("stopped at once") and f"resume with: p4bench run --resume {folder}" in last
    )
    store = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (logged,) = store.search_runs([store.get_experiment_by_name("p4bench").experiment_id])
    assert logged.info.status == "KILLED" and logged.info.run_name == "fedavg-none-none-digits-0"


def test_sweep_interrupted_resumes_its_run_and_a_finished_sweep_exits_normally(tmp_path):
    runs = str(tmp_path / "runs")
    spec = parse_sweep(
        {
            "name": "resumable",
            "base": {"dataset": "digits", "clients": 4, "rounds": 3, "local_steps": 1},
            "axes": {"method": ["local", "fedavg"]},
        }
    )
    with pytest.raises(SweepInterrupted) as stopped:
        _sweep_stopping_at(spec, runs, step=2)
    first, second = stopped.value.report.records
    assert first.status == "interrupted" and first.error != "not started"
    assert second.status == "interrupted" and second.error == "not started"
    again = run_sweep(spec, results_dir=runs)
    assert [r.status for r in again.records] == ["finished", "finished"]
    assert again.records[0].mlflow_run_id == first.mlflow_run_id  # the same MLflow run, resumed
    assert [r["step"] for r in again.records[0].rounds] == [1, 2, 3]
    # a stop request in the last round of the last run: every run is done, so no interrupt
    fresh = parse_sweep(
        {
            "name": "done",
            "base": {"dataset": "digits", "clients": 4, "rounds": 2, "local_steps": 1},
            "axes": {"method": ["local"]},
        }
    )
    report = _sweep_stopping_at(fresh, runs, step=2)
    assert [r.status for r in report.records] == ["finished"]


def _sweep_stopping_at(spec, runs: str, step: int):
    from p4bench.host.manager import create_plugin_manager
    from p4bench.studies.backends import LocalBackend

    pm = create_plugin_manager(extra_plugins=(StopAfterStep(step),), autoload=False)
    return run_sweep(spec, LocalBackend(plugin_manager=pm), results_dir=runs)
