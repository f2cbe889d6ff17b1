"""A run chooses its torch threads (`--threads`, else the cores it may use) instead of
inheriting torch's default; the number is what training ran on, and the summary, the
`--json` line and the MLflow parameters record it (issue 49, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p4bench.errors import ConfigError
from p4bench.hookspecs import hookimpl
from p4bench.run.runner import run
from p4bench.run.threads import set_process_share, share_of, usable_cores
from p4bench.studies.backends import LocalBackend
from p4bench.studies.run_task import RunTask


class ThreadsProbe:
    """Observer: torch's thread count while the rounds train (`round_finished` is called
    between a round's training and the next, in the training thread)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @hookimpl
    def round_finished(self, run, report):
        self.seen.append(torch.get_num_threads())


@pytest.fixture
def process_threads():
    """torch's process-wide thread count, set to 3 for the test (not what any run here is
    given) and restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_trains_on_the_threads_it_is_given_and_records_them(
    small_config, process_threads, threads
):
    probe = ThreadsProbe()
    result = run(small_config(rounds=2, threads=threads), observers=[probe], track=False)
    assert probe.seen == [threads, threads]
    assert result.summary["threads"] == threads
    assert result.info.config.threads == threads  # the config the tracker logs as parameters
    assert torch.get_num_threads() == process_threads  # the process's own number is back


def test_without_threads_a_run_alone_takes_every_usable_core(
    small_config, process_threads, monkeypatch
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    probe = ThreadsProbe()
    result = run(small_config(rounds=2), observers=[probe], track=False)
    assert probe.seen == [usable_cores()] * 2
    assert result.summary["threads"] == usable_cores()


def test_omp_num_threads_is_a_ceiling_of_the_default_not_of_threads(
    small_config, process_threads, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(small_config(rounds=2), track=False).summary["threads"] == 1
    assert run(small_config(rounds=2, threads=2), track=False).summary["threads"] == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # above the cores: the cores decide
    assert run(small_config(rounds=2), track=False).summary["threads"] == usable_cores()


def test_a_worker_share_is_the_default_of_the_runs_in_that_process(
    small_config, process_threads, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # no ceiling below the share
    set_process_share(1)
    try:
        result = run(small_config(rounds=2), track=False)
    finally:
        set_process_share(None)
    assert result.summary["threads"] == 1


def test_a_sweep_with_two_jobs_gives_each_run_half_the_cores(small_config, monkeypatch):
    # the workers inherit a default of 3 threads: each run must set its share itself
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    tasks = [
        RunTask(small_config(rounds=2, seed=seed).to_dict(), track=False, autoload=False)
        for seed in (1, 2)
    ]
    records = {}
    LocalBackend(jobs=2).map(tasks, lambda index, record: records.__setitem__(index, record))
    assert [records[i].status for i in (0, 1)] == ["finished", "finished"]
    assert [records[i].summary["threads"] for i in (0, 1)] == [share_of(2)] * 2
    assert share_of(2) == max(1, usable_cores() // 2)


def test_threads_do_not_change_the_config_hash(small_config):
    assert small_config(threads=1).config_hash() == small_config().config_hash()


@pytest.mark.parametrize("value", [0, -2, 1.5, "two", True])
def test_a_bad_thread_count_is_refused(small_config, value):
    with pytest.raises(ConfigError, match="threads"):
        small_config(threads=value)


def test_the_json_line_and_mlflow_record_the_threads(tmp_path):
    store = tmp_path / "runs"
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "p4bench"),
            "run",
            "--method",
            "fedavg",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--local-steps",
            "1",
            "--threads",
            "2",
            "--results-dir",
            str(store),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["threads"] == 2
    assert "s on cpu, 2 threads" in done.stderr  # the summary table's wall time row
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=summary["tracking_uri"])
    assert client.get_run(summary["run_id"]).data.params["threads"] == "2"
