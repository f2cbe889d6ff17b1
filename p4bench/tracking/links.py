"""Where a run's results are seen, and the up-front check of a named tracking server.

The runs table: each experiment p4bench logs to carries a saved view of MLflow's runs page
(MLflow >= 3.15: an experiment tag `mlflow.sharedViewState.<id>` holding a JSON envelope
`{name, createdAt, updatedAt, state}`; the link `#/experiments/<id>/runs?viewStateShareKey=<id>`
opens it). Its columns are the run's method, attack and defense (params), its final
accuracy and epsilon (metrics) and whether that epsilon is certified (a tag). MLflow's URL
itself selects no columns (its search parameters are filters and sorting only); opened
without the view, the runs page shows the columns chosen in that browser. `p4bench compare
--experiment NAME --group-by method,attack,defense,epsilon`, printed beside the link, gives
the same figures as a table (the accuracy's mean over seeds).

A run's and a sweep's last lines (`where_to_look`) name the link, for a local SQLite store
the `mlflow ui` command that serves it, and the compare command. The experiment's id is
read from the store without importing MLflow (SQLite read-only, or the server's REST API).

`check_server` is the up-front check of `run` and the studies: a tracking server named by
`--tracking-uri` or `MLFLOW_TRACKING_URI` that does not answer is one line and exit 2,
before anything is trained (the tracker itself still copes with a server lost mid-run).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p4bench.errors import UsageError

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = [
    "RUNS_VIEW_COLUMNS",
    "RUNS_VIEW_KEY",
    "RUNS_VIEW_TAG",
    "UI_ADDRESS",
    "check_study_server",
    "check_run_server",
    "check_server",
    "compare_command",
    "runs_view_tag",
    "where_to_look",
]

RUNS_VIEW_KEY = "p4bench"  # the saved view's id: the tag's suffix and the link's viewStateShareKey
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_NAME = "p4bench: method, attack, defense, accuracy, epsilon"
RUNS_VIEW_COLUMNS: tuple[tuple[str, str], ...] = (  # (params | metrics | tags, key)
    ("params", "method"),
    ("params", "attack"),
    ("params", "defense"),
    ("metrics", "final_accuracy_mean"),
    ("metrics", "final_accuracy_global_mean"),  # runs with --eval global|both only
    ("metrics", "epsilon"),  # private runs only: a non-private run logs none (never 0)
    ("tags", "dp.certified"),
)
SAVED_VIEWS_SINCE = (3, 15)  # the MLflow release whose runs page opens saved views
UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
COMPARE_KEYS = "method,attack,defense,epsilon"  # compare's columns beside the accuracy
_TIMEOUT = 5.0


def column_key(kind: str, key: str) -> str:
    """MLflow's column id (`makeCanonicalSortKey`): e.g. params.`method`."""
    return f"{kind}.`{key}`"


def runs_view_tag(now_ms: int | None = None) -> tuple[str, str]:
    """The experiment tag of the saved view: its key and its envelope (state in plain JSON)."""
    state = {"selectedColumns": [column_key(kind, key) for kind, key in RUNS_VIEW_COLUMNS]}
    stamp = int(time.time() * 1000) if now_ms is None else now_ms
    envelope = {
        "name": RUNS_VIEW_NAME,
        "createdAt": stamp,
        "updatedAt": stamp,
        "state": json.dumps(state),
    }
    return RUNS_VIEW_TAG, json.dumps(envelope)


# -- the up-front check -------------------------------------------------------------------
def check_server(uri: str, named_by: str, local_store: str | None = None) -> None:
    """A UsageError (one line, exit 2) where `uri` is an http(s) server that does not accept
    a connection; other stores are checked by `p4bench.run.preflight`."""
    from p4bench.tracking.stores import TRACKING_URI_ENV, _server_reachable

    if urllib.parse.urlsplit(uri).scheme not in ("http", "https") or _server_reachable(uri):
        return
    instead = f" to log to the local store {local_store}" if local_store else ""
    how = f"{'unset' if named_by == TRACKING_URI_ENV else 'leave out'} {named_by}{instead}"
    raise UsageError(
        f"MLflow tracking server {_shown(uri)} (from {named_by}) cannot be reached; nothing was "
        f"run: start the server, or {how}"
    )


def check_run_server(config: RunConfig) -> None:
    """`check_server` for `p4bench run` (the URI as the tracker derives it)."""
    from p4bench.tracking.stores import TRACKING_URI_ENV

    uri = config.tracking_uri or os.environ.get(TRACKING_URI_ENV)
    if uri:
        named_by = "--tracking-uri" if config.tracking_uri else TRACKING_URI_ENV
        check_server(uri, named_by, _local_store(config.results_dir))


def check_study_server(results_dir: str | Path | None, tracking_uri: str | None) -> None:
    """`check_server` for a study (sweep, tune, reproduce): the URI it will log to."""
    from p4bench.config import RunConfig
    from p4bench.tracking.stores import TRACKING_URI_ENV

    uri = tracking_uri or os.environ.get(TRACKING_URI_ENV)
    if uri:
        named_by = "--tracking-uri" if tracking_uri else TRACKING_URI_ENV
        check_server(uri, named_by, _local_store(str(results_dir or RunConfig.results_dir)))


def _local_store(results_dir: str) -> str:
    return "sqlite:///" + str((Path(results_dir) / "mlflow.db").resolve())


def _shown(uri: str, user: bool = True) -> str:
    """The URI without its password (`user`), or without user and password."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = f"{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    who = f"{parts.username}:***@" if user and parts.password is not None else ""
    who = who or (f"{parts.username}@" if user and parts.username else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=who + host))


# -- the links ----------------------------------------------------------------------------
def where_to_look(uri: str, experiment: str | None = None, run_id: str | None = None) -> list[str]:
    """The lines that end a run (`run_id`) or a sweep (`experiment`): the runs table's link,
    how to serve it, the run's own page, and the compare command. Empty where the store
    holds neither (an untracked run) or is of a kind with no known UI address."""
    found = _experiment(uri, experiment, run_id)
    base = _ui_base(uri)
    if found is None or base is None:
        return []
    experiment_id, name = found
    table = f"{base}/#/experiments/{experiment_id}/runs"
    view = _has_saved_views(uri)
    lines = [
        f"MLflow runs table: {table}" + (f"?viewStateShareKey={RUNS_VIEW_KEY}" if view else "")
    ]
    if urllib.parse.urlsplit(uri).scheme == "sqlite":
        lines.append(
            f"  start the UI first: {_mlflow_command()} ui --backend-store-uri {shlex.quote(uri)}"
        )
    if run_id is not None:
        lines.append(f"  this run: {table}/{run_id}")
    columns = "method, attack, defense, accuracy, epsilon"
    said = (
        f"columns {columns} (the link opens MLflow's saved view of them)"
        if view
        else f"columns are chosen in the UI (MLflow < 3.15 keeps no saved view): add {columns}"
    )
    lines.append(f"  {said}; as a table: {compare_command(name, uri)}")
    return lines


def compare_command(experiment: str, uri: str) -> str:
    """`p4bench compare --experiment NAME --group-by method,attack,defense,epsilon` (the
    accuracy's mean, std and n beside them), with `--tracking-uri` where compare would not
    find the store by itself (run from the same folder)."""
    from p4bench.config import RunConfig
    from p4bench.tracking.stores import tracking_uri_for

    command = f"p4bench compare --experiment {shlex.quote(experiment)} --group-by {COMPARE_KEYS}"
    if uri != tracking_uri_for(None, RunConfig.results_dir):
        command += f" --tracking-uri {shlex.quote(uri)}"
    return command


def _ui_base(uri: str) -> str | None:
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return _shown(uri, user=False).rstrip("/")
    return UI_ADDRESS if scheme == "sqlite" else None


def _mlflow_command() -> str:
    """`mlflow` where it is this interpreter's, else the path of this environment's script."""
    import shutil

    script = Path(sys.executable).parent / "mlflow"
    found = shutil.which("mlflow")
    if not script.exists() or (found and Path(found).resolve() == script.resolve()):
        return "mlflow"
    return str(script)


def _has_saved_views(uri: str) -> bool:
    """Whether the UI that shows `uri` opens saved views: the installed MLflow's (it serves
    a SQLite store), else the server's own version (`GET /version`)."""
    import importlib.metadata

    if urllib.parse.urlsplit(uri).scheme in ("http", "https"):
        version = _http(uri, "version", {}, raw=True)
    else:
        try:
            version = importlib.metadata.version("mlflow")
        except importlib.metadata.PackageNotFoundError:
            return False
    try:
        release = tuple(int(part) for part in str(version).split(".")[:2])
    except ValueError:
        return False
    return release >= SAVED_VIEWS_SINCE


def _experiment(uri: str, experiment: str | None, run_id: str | None) -> tuple[str, str] | None:
    """The experiment's (id, name): that of `run_id`, else the one named `experiment`."""
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme == "sqlite":
        return _sqlite_experiment(uri, experiment, run_id)
    if scheme not in ("http", "https"):
        return None
    if run_id is not None:
        run = _http(uri, "api/2.0/mlflow/runs/get", {"run_id": run_id})
        found = (run or {}).get("run", {}).get("info", {}).get("experiment_id")
        if found is None:
            return None
        got = _http(uri, "api/2.0/mlflow/experiments/get", {"experiment_id": found})
    elif experiment is not None:
        got = _http(uri, "api/2.0/mlflow/experiments/get-by-name", {"experiment_name": experiment})
    else:
        return None
    info = (got or {}).get("experiment", {})
    return (str(info["experiment_id"]), str(info["name"])) if "experiment_id" in info else None


def _sqlite_experiment(
    uri: str, experiment: str | None, run_id: str | None
) -> tuple[str, str] | None:
    import contextlib
    import sqlite3

    from p4bench.tracking.stores import sqlite_path

    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return None
    if run_id is not None:
        query = (
            "SELECT e.experiment_id, e.name FROM runs r JOIN experiments e "
            "ON e.experiment_id = r.experiment_id WHERE r.run_uuid = ?"
        )
        wanted: Sequence[str] = (run_id,)
    elif experiment is not None:
        query = (
            "SELECT experiment_id, name FROM experiments "
            "WHERE name = ? AND lifecycle_stage = 'active'"
        )
        wanted = (experiment,)
    else:
        return None
    address = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(address, uri=True, timeout=_TIMEOUT)) as db:
            row = db.execute(query, wanted).fetchone()
    except sqlite3.Error:
        return None
    return (str(row[0]), str(row[1])) if row else None


def _http(uri: str, path: str, query: dict[str, str], raw: bool = False) -> Any:
    """GET `<uri>/<path>?<query>` from an MLflow server: its JSON (or text); None on failure."""
    import base64
    import urllib.request

    url = f"{uri.rstrip('/')}/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    request = urllib.request.Request(url)
    user, password = (
        os.environ.get("MLFLOW_TRACKING_USERNAME"),
        os.environ.get("MLFLOW_TRACKING_PASSWORD"),
    )
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    elif user and password:
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT) as answer:  # the user's server
            text = answer.read().decode()
    except (OSError, ValueError):
        return None
    if raw:
        return text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return None
