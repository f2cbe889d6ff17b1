"""One MLflow run per planned run of a study, whatever happened to earlier attempts.

A sweep's run can be attempted more than once: Ray runs a task again when its worker or
node dies, and running the sweep again after a killed worker or driver starts the runs
that did not finish. An attempt that died with its worker leaves its MLflow run RUNNING
for ever; an attempt whose node died after it finished logging left a FINISHED run that
the sweep never heard of. Before a sweep's run starts, `settle_attempts` therefore looks up
the earlier attempts of the same run: same experiment and config hash, and the same
`planned_run` tag (a digest of all the planned run's tags: sweep, variant, tuning point,
tuning flag, ..., logged on every attempt):

- a FINISHED one is the result: the run is not trained again (the sweep records it as skipped);
- RUNNING ones are attempts that died: each is tagged `superseded` and deleted (MLflow's
  soft delete: hidden from searches and the UI, restorable with `mlflow runs restore`), so
  the experiment keeps one run per grid point.

KILLED runs (stopped by Ctrl-C, resumed from their checkpoint) and FAILED ones (the record
of an error) are left alone. This assumes one driver per sweep at a time: two drivers of
the same sweep would supersede each other's live runs.

`record_failure` marks a failed run FAILED in MLflow, creating it if it failed first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from p4bench.config import RunConfig

__all__ = [
    "SUPERSEDED_TAG",
    "PLANNED_RUN_TAG",
    "planned_run_key",
    "settle_attempts",
    "run_row",
    "finished_summary",
    "record_failure",
]

SUPERSEDED_TAG = "superseded"
PLANNED_RUN_TAG = "planned_run"


def planned_run_key(tags: Mapping[str, str]) -> str:
    """The `planned_run` tag of a sweep run with these tags (its config hash is a tag of its own)."""
    text = json.dumps({str(k): str(v) for k, v in tags.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def settle_attempts(
    uri: str, config: RunConfig, tags: Mapping[str, str], keep: str | None = None
) -> Any:
    """The FINISHED MLflow run of an earlier attempt of this sweep run (an mlflow Run), or
    None after deleting the earlier attempts left RUNNING (all but `keep`, the run a
    checkpoint resumes). Never raises: a store that cannot be read leaves things as they are."""
    sweep = tags.get("sweep")
    if not sweep:
        return None
    try:
        from p4bench.studies.results import store_client

        client = store_client(uri)
        experiment = client.get_experiment_by_name(config.experiment)
        if experiment is None:
            return None
        runs = client.search_runs(
            [experiment.experiment_id],
            max_results=1000,
            filter_string=f"tags.config_hash = '{config.config_hash()}' and "
            f"tags.{PLANNED_RUN_TAG} = '{planned_run_key(tags)}'",
        )
        finished = [r for r in runs if r.info.status == "FINISHED"]
        if finished:
            return max(finished, key=lambda r: r.info.start_time or 0)
        for run in runs:
            if run.info.status == "RUNNING" and run.info.run_id != keep:
                client.set_tag(
                    run.info.run_id,
                    SUPERSEDED_TAG,
                    "an attempt lost with its worker; the run was started again",
                )
                client.delete_run(run.info.run_id)
    except Exception:  # noqa: BLE001 - bookkeeping only: the run goes ahead
        return None
    return None


def run_row(run: Any) -> dict[str, Any]:
    """An mlflow Run as a row of `p4bench.studies.results.load_runs` (tags, `params.*`, `metrics.*`)."""
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
    }
    row.update({k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")})
    row.update({f"params.{k}": v for k, v in run.data.params.items()})
    row.update({f"metrics.{k}": v for k, v in run.data.metrics.items()})
    return row


def finished_summary(
    config: RunConfig, row: Mapping[str, Any]
) -> tuple[dict[str, Any], float | None]:
    """What a sweep keeps of a run finished earlier (a row of the store): its summary (run id,
    accuracy, privacy) and its evaluation clients' final accuracy."""
    from p4bench.studies.equal_privacy import from_row

    def metric(name: str) -> float | None:
        value = row.get(f"metrics.{name}")
        return None if value is None or value != value else float(value)

    privacy = from_row({"method": config.method, **row})
    summary = {
        "run_id": row.get("run_id"),
        "accuracy_mean": metric("final_accuracy_mean"),
        "method": config.method,
        "seed": config.seed,
        "private": privacy.private,
    }
    if privacy.private:  # a non-private run's epsilon stays None (no DP), as a run's own summary
        summary.update(
            neighbouring=privacy.neighbouring,
            epsilon_certified=privacy.certified,
            uncertified_reason=privacy.reason,
            epsilon=metric("epsilon"),
            epsilon_evaluation_clients=metric("epsilon_evaluation_clients"),
        )
    return summary, metric("accuracy_evaluation_mean")


def record_failure(
    config: RunConfig, tracker: Any, tags: Mapping[str, str], error: str | None
) -> str | None:
    """Mark the run FAILED in MLflow (creating it if it failed before it started), so the
    experiment records the failure; a resumed sweep runs it again."""
    if tracker is None:
        return None
    try:
        from p4bench.studies.results import ensure_experiment, store_client
        from p4bench.tracking.tracker import flat_params, run_name

        client = store_client(tracker.uri)
        run_id = tracker.mlflow_run_id
        if run_id is None:
            experiment_id = ensure_experiment(tracker.uri, config.experiment)
            defense = _resolved_defense(config)
            base = {
                "method": config.method,
                "attack": config.attack or "none",
                "defense": defense or "none",
                "dataset": config.dataset,
                "seed": str(config.seed),
                "config_hash": config.config_hash(),
            }
            run_id = client.create_run(
                experiment_id, tags={**tags, **base}, run_name=run_name(config, defense)
            ).info.run_id
            from mlflow.entities import Param

            client.log_batch(
                run_id,
                params=[
                    Param(k, v) for k, v in flat_params(config, defense=defense or "none").items()
                ],
            )
        client.set_tag(run_id, "error", (error or "")[:5000])
        client.set_terminated(run_id, "FAILED")
        return str(run_id)
    except Exception:  # noqa: BLE001 - the failure is still in the sweep's summary
        return None


def _resolved_defense(config: RunConfig) -> str | None:
    """The run's defense: the config's, else its method's default (None: no defense);
    the config's own value where the method cannot be looked up."""
    if config.defense is not None:
        return None if config.defense == "none" else config.defense
    try:
        from p4bench.host.manager import default_registry

        default = getattr(default_registry().get("method", config.method), "default_defense", None)
    except Exception:  # noqa: BLE001 - an unknown method: the failure being recorded says so
        return None
    return None if default in (None, "none") else str(default)
