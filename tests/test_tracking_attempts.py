"""One MLflow run per planned run of a sweep (`p4bench.studies.attempts`), without Ray: an
attempt lost with its worker (left RUNNING) is superseded when the run starts again, and an
attempt that finished is not trained again. The two-node version is tests/test_ray_cluster.py."""

from __future__ import annotations

from p4bench.config import RunConfig
from p4bench.studies.attempts import PLANNED_RUN_TAG, SUPERSEDED_TAG, planned_run_key
from p4bench.studies.backends import RunTask, execute_task
from p4bench.studies.results import ensure_experiment, store_client, tracking_uri_for


def test_a_lost_attempt_is_superseded_and_a_finished_one_is_not_trained_again(tmp_path):
    uri = tracking_uri_for(None, str(tmp_path))
    config = RunConfig(
        method="fedavg",
        dataset="digits",
        clients=4,
        rounds=1,
        local_steps=1,
        experiment="lost",
        results_dir=str(tmp_path),
        tracking_uri=uri,
    )
    tags = {"sweep": "lost"}
    client = store_client(uri)
    experiment = ensure_experiment(uri, "lost")
    same = {
        "sweep": "lost",
        "tuning": "false",
        "config_hash": config.config_hash(),
        PLANNED_RUN_TAG: planned_run_key({"sweep": "lost", "tuning": "false"}),
    }
    orphan = client.create_run(
        experiment, tags=same
    ).info.run_id  # RUNNING for ever: its worker died
    variant = {
        "sweep": "lost",
        "variant": "b",
        "tuning": "false",
    }  # another planned run, same config
    other = client.create_run(
        experiment, tags={**same, **variant, PLANNED_RUN_TAG: planned_run_key(variant)}
    ).info.run_id

    record = execute_task(RunTask(config.to_dict(), tags))
    assert record.status == "finished", record.error
    lost = client.get_run(orphan)
    assert lost.info.lifecycle_stage == "deleted" and SUPERSEDED_TAG in lost.data.tags
    assert client.get_run(other).info.lifecycle_stage == "active"  # not an attempt of this run

    again = execute_task(
        RunTask(config.to_dict(), tags)
    )  # e.g. Ray retrying a task whose answer was lost
    assert again.status == "skipped" and again.mlflow_run_id == record.mlflow_run_id
    assert again.summary["accuracy_mean"] == record.summary["accuracy_mean"]
    finished = client.search_runs([experiment], filter_string="attributes.status = 'FINISHED'")
    assert [r.info.run_id for r in finished] == [record.mlflow_run_id]
