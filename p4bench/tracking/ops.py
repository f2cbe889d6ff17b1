"""What the tracker asks of MLflow, in plain values: the only module that builds MLflow
entities for a run being trained.

`MlflowOps` runs where MLflow is imported: in the run's own process, or in the tracking
worker (`p4bench.tracking.worker`) that `p4bench run` starts beside it. Its arguments and
results are plain values (strings, numbers, tuples, dicts), so the run's process never
imports MLflow when the worker writes for it.

`LocalBackend` calls the operations in this process. A backend never raises: the first
failure is kept as one line (`error`) and every later call is skipped, so tracking never
ends a run and a run's MLflow record is whole or says that it is not.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p4bench.tracking.links import RUNS_VIEW_TAG, runs_view_tag

__all__ = ["DatasetSpec", "LocalBackend", "MlflowOps", "Reply", "failure_line", "open_failure_line"]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MetricRow = tuple[str, float, int, int]  # key, value, timestamp (ms), step
DatasetSpec = Mapping[str, str]  # name, digest, source, profile (JSON): an MLflow dataset input


def failure_line(action: str, exc: BaseException) -> str:
    """`MLflow <action> failed (<type>: <first line>)`."""
    return f"MLflow {action} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"


def open_failure_line(uri: str, exc: BaseException) -> str:
    """Opening a store can fail (MLflow refuses some stores when it opens them)."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"MLflow store {uri} cannot be opened ({type(exc).__name__}: {first})"


def import_mlflow() -> None:
    """Import what the operations use (the bulk of a run's start-up when done in its process)."""
    for noisy in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import mlflow.entities  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - the SQLite store's module: most of the cost
    import mlflow.tracking  # noqa: F401


class MlflowOps:
    """The tracker's MLflow operations on one store, for the run it started or reopened
    (later operations need no run id: the run's process need not wait for it)."""

    def __init__(self, uri: str) -> None:
        import_mlflow()
        from mlflow.tracking import MlflowClient

        from p4bench.tracking.store import seed_sqlite_store

        seed_sqlite_store(
            uri
        )  # a new SQLite store: a copy of a migrated empty one, not ~1 s of migrations
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = ""

    def start_run(
        self,
        experiment: str,
        tags: Mapping[str, str],
        run_name: str,
        params: Mapping[str, str],
        dataset: DatasetSpec | None,
    ) -> str:
        """Create the run (and its experiment, opening on the runs table, with the saved view of
        `p4bench.tracking.links`); its MLflow run id."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param

        client = self.client
        found = client.get_experiment_by_name(experiment)
        if found is None:
            location = None
            if self.uri.startswith("sqlite:///"):
                location = (
                    (Path(self.uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
                )
            experiment_id = client.create_experiment(experiment, artifact_location=location)
        else:
            experiment_id = found.experiment_id
        kept = (found.tags or {}) if found is not None else {}
        if EXPERIMENT_KIND_TAG not in kept:
            # MLflow 3's UI opens an experiment without a kind on its GenAI overview: open on the runs table
            client.set_experiment_tag(
                experiment_id, EXPERIMENT_KIND_TAG, "custom_model_development"
            )
        if RUNS_VIEW_TAG not in kept:  # the runs table's columns, opened by the printed link
            client.set_experiment_tag(experiment_id, *runs_view_tag())
        run_id: str = client.create_run(
            experiment_id, tags=dict(tags), run_name=run_name
        ).info.run_id
        self.run_id = run_id
        listed = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(listed), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id, params=listed[start : start + 100])
        if dataset is not None:
            given = Dataset(
                name=dataset["name"],
                digest=dataset["digest"],
                source_type="p4bench",
                source=dataset["source"],
                profile=dataset["profile"],
            )
            inputs = [DatasetInput(given, tags=[InputTag("mlflow.data.context", "training")])]
            try:
                client.log_inputs(run_id, datasets=inputs)
            except Exception as error:
                # two runs of one experiment starting together both insert the dataset's row;
                # the one that loses finds it on a second try
                if "UNIQUE constraint" not in str(error):
                    raise
                client.log_inputs(run_id, datasets=inputs)
        return run_id

    def reopen_run(self, run_id: str, tags: Mapping[str, str]) -> str:
        """Go on logging into an interrupted run (status RUNNING again); its id."""
        self.client.get_run(run_id)  # raises for a run the store does not hold
        self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.set_tags(tags)
        return run_id

    def log_metrics(self, rows: Sequence[MetricRow]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key, float(value), int(stamp), int(step)) for key, value, stamp, step in rows
        ]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def log_artifacts(self, paths: Sequence[str]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def terminate(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


class Reply:
    """A value an operation returns, read when it is needed (`value()`; None if it failed)."""

    def __init__(self, value: Any = None) -> None:
        self._value = value

    def value(self) -> Any:
        return self._value


class LocalBackend:
    """`MlflowOps` in this process, guarded: the first failure is kept and ends the tracking."""

    def __init__(self, uri: str) -> None:
        self.error: str | None = None
        self.ops: MlflowOps | None = None
        try:
            self.ops = MlflowOps(uri)
        except Exception as exc:  # noqa: BLE001 - reported as one line, the run goes on
            self.error = open_failure_line(uri, exc)
            logging.getLogger(__name__).warning(self.error)

    def ask(self, action: str, op: str, *args: Any) -> Reply:
        """Run `op` now; its result (None once anything failed)."""
        if self.ops is None:
            return Reply(None)
        try:
            return Reply(getattr(self.ops, op)(*args))
        except Exception as exc:  # noqa: BLE001 - tracking must never end a run
            self.error = failure_line(action, exc)
            logging.getLogger(__name__).warning(self.error)
            self.ops = None
            return Reply(None)

    def call(self, action: str, op: str, *args: Any) -> None:
        self.ask(action, op, *args)

    def close(self) -> str | None:
        """The first failure, if any (nothing is pending in this process)."""
        return self.error


def dataset_spec(name: str, digest: str, source: str, profile: Mapping[str, Any]) -> dict[str, str]:
    """A dataset input in plain values (`MlflowOps.start_run` builds the MLflow entity)."""
    return {"name": name, "digest": digest, "source": source, "profile": json.dumps(dict(profile))}
