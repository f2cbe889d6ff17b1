"""Where runs are logged: the tracking URI a run or study derives, the SQLite file behind a
local store, and an MLflow client for it (MLflow is imported only when a client is made)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = [
    "TRACKING_URI_ENV",
    "default_tracking_uri",
    "ensure_experiment",
    "sqlite_path",
    "store_client",
    "tracking_uri_for",
]

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"


def default_tracking_uri(results_dir: str) -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store `<results_dir>/mlflow.db`."""
    if os.environ.get(TRACKING_URI_ENV):
        return os.environ[TRACKING_URI_ENV]
    return "sqlite:///" + str((Path(results_dir) / "mlflow.db").resolve())


def _server_reachable(uri: str, timeout: float = 3.0) -> bool:
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return True
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout):
            return True
    except OSError:
        return False


def tracking_uri_for(tracking_uri: str | None, results_dir: str) -> str:
    """The URI runs are logged to: the explicit one, else $MLFLOW_TRACKING_URI, else the
    SQLite store in `results_dir` (as the tracker does), with the folder made absolute so
    that worker processes and Ray workers write to the same store."""
    return tracking_uri or default_tracking_uri(str(Path(results_dir).resolve()))


def sqlite_path(uri: str) -> Path | None:
    """The database file of an `sqlite:///...` URI; None for other URIs and in-memory stores."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///") :].split("?", 1)[0])
    return None if path in ("", ":memory:") else Path(path)


def store_client(uri: str) -> Any:
    """An MlflowClient for `uri` (creating a SQLite store's folder first)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    for noisy in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_experiment(uri: str, name: str) -> str:
    """Create the experiment (and the store's schema) once, before workers log into it
    concurrently; returns its id."""
    client = store_client(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
    return str(client.create_experiment(name, artifact_location=location))
