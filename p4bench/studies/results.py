"""Reading finished runs back from the MLflow store: for resuming sweeps, `compare` and `reproduce`.

One row per run, with the tags (method, attack, defense, dataset, seed, config_hash, sweep, ...)
as plain columns, parameters as `params.<name>` and the latest value of every metric as
`metrics.<name>`. Only this module talks to the store for reading.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from p4bench.errors import UsageError
from p4bench.tracking.stores import (  # re-exported: they were defined here
    ensure_experiment,
    store_client,
    tracking_uri_for,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "tracking_uri_for",
    "store_client",
    "ensure_experiment",
    "load_runs",
    "finished_runs",
    "TUNING_TAG",
]

TUNING_TAG = "tuning"  # "true" on tuning runs (reported clients' test splits withheld)
_PAGE = 1000


def _runs(client: Any, experiment_id: str, filter_string: str) -> Iterable[Any]:
    token = None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string=filter_string, max_results=_PAGE, page_token=token
        )
        yield from page
        token = page.token
        if not token:
            return


def load_runs(
    uri: str, experiment: str, statuses: tuple[str, ...] = ("FINISHED",), required: bool = True
) -> pd.DataFrame:
    """A pandas DataFrame of the experiment's runs with one of `statuses`.

    Columns: run_id, status, start_time, every tag, `params.<name>`, `metrics.<name>`.
    Raises UsageError when the experiment does not exist and `required`.
    """
    import pandas as pd

    client = store_client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        if required:
            raise UsageError(f"no MLflow experiment named '{experiment}' at {uri}")
        return pd.DataFrame()
    rows = []
    clause = (
        f"attributes.status = '{statuses[0]}'" if len(statuses) == 1 else ""
    )  # else filtered below
    for run in _runs(client, found.experiment_id, clause):
        if run.info.status not in statuses:
            continue
        row: dict[str, Any] = {
            "run_id": run.info.run_id,
            "status": run.info.status,
            "start_time": run.info.start_time,
        }
        row.update({k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")})
        row.update({f"params.{k}": v for k, v in run.data.params.items()})
        row.update({f"metrics.{k}": v for k, v in run.data.metrics.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def finished_runs(uri: str, experiment: str) -> dict[tuple[str, bool], dict[str, Any]]:
    """Finished runs keyed by (config_hash, tuning): the latest one per key, as a row dict."""
    frame = load_runs(uri, experiment, required=False)
    if frame.empty or "config_hash" not in frame:
        return {}
    out: dict[tuple[str, bool], dict[str, Any]] = {}
    for row in frame.sort_values("start_time", kind="stable").to_dict("records"):
        tuning = str(row.get(TUNING_TAG, "false")).lower() == "true"
        if isinstance(row.get("config_hash"), str):
            out[(row["config_hash"], tuning)] = row
    return out


def metric_history(uri: str, run_ids: Iterable[str], metric: str) -> pd.DataFrame:
    """Per-step history of `metric` for each run: DataFrame(run_id, step, value)."""
    import pandas as pd

    client = store_client(uri)
    rows = [
        {"run_id": run_id, "step": m.step, "value": m.value}
        for run_id in run_ids
        for m in client.get_metric_history(run_id, metric)
    ]
    return pd.DataFrame(rows, columns=["run_id", "step", "value"])
