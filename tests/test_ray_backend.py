"""The Ray backend gives the same per-run metrics as the in-process backend (local Ray instance)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'p4bench[ray]'")

from mlflow.tracking import MlflowClient  # noqa: E402

from p4bench.studies.backends import RayBackend, RunTask, execute_task  # noqa: E402
from p4bench.studies.sweep import parse_sweep, run_sweep  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_sweep_matches_in_process_runs_and_logs_to_one_experiment(local_ray, tmp_path):
    results = str(tmp_path / "runs")
    spec = parse_sweep(
        {
            "name": "on-ray",
            "base": {"dataset": "digits", "clients": 8, "rounds": 2, "local_steps": 2},
            "axes": {"method": ["fedavg", "p4"], "seed": [4]},
        }
    )
    report = run_sweep(spec, RayBackend(), results_dir=results)
    assert [r.status for r in report.records] == ["finished", "finished"], [
        r.error for r in report.records
    ]
    for planned, record in zip(report.planned, report.records):
        reference = execute_task(RunTask(planned.config.to_dict(), track=False))
        assert record.rounds == reference.rounds  # every round's accuracy, exactly
        assert record.summary["accuracy_per_client"] == reference.summary["accuracy_per_client"]
    client = MlflowClient(tracking_uri=report.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("on-ray").experiment_id])
    assert sorted(r.data.tags["method"] for r in runs) == ["fedavg", "p4"]
    assert all(r.info.status == "FINISHED" and r.data.tags["sweep"] == "on-ray" for r in runs)
    again = run_sweep(spec, RayBackend(), results_dir=results)
    assert [r.status for r in again.records] == ["skipped", "skipped"]
