"""A new SQLite MLflow store in milliseconds: a copy of an empty, migrated one.

MLflow creates a SQLite store by running every Alembic migration of its schema, about
1 s on a small machine, and each run into a fresh results folder pays it. The first
store created on a machine is kept, emptied, as a template in the cache folder
(`<cache dir>/mlflow/store-<mlflow version>.db`); a new store is a copy of it. The copy
holds what MLflow's own creation leaves (the schema at the same revision, the default
workspace) except the ``Default`` experiment, which MLflow adds when it opens a store
without one, with the artifact location it would have given it when creating the store.

Seeding is an optimisation only: anything unexpected (another URI, an existing file,
a folder that cannot be written, an unusable template) leaves the store to MLflow, so
errors and results are those of MLflow's own creation.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import sqlite3
from pathlib import Path

__all__ = ["seed_sqlite_store", "template_path"]

_PREFIX = "sqlite:///"


def template_path() -> Path | None:
    """Where the template of the installed MLflow lives; None without MLflow."""
    from p4bench.data.paths import cache_dir

    try:
        version = importlib.metadata.version("mlflow-skinny")
    except importlib.metadata.PackageNotFoundError:
        try:
            version = importlib.metadata.version("mlflow")
        except importlib.metadata.PackageNotFoundError:
            return None
    return cache_dir() / "mlflow" / f"store-{version}.db"


def _store_file(uri: str) -> Path | None:
    """The file of a plain `sqlite:///PATH` URI, else None (memory, query options)."""
    if not uri.startswith(_PREFIX) or "?" in uri:
        return None
    path = uri[len(_PREFIX) :]
    return Path(path) if path and path != ":memory:" else None


def _usable(template: Path) -> bool:
    """An empty store at some revision: one Alembic revision, no experiment, no run."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{template}?mode=ro", uri=True)) as db:
            revisions = db.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
            experiments = db.execute("SELECT count(*) FROM experiments").fetchone()[0]
            runs = db.execute("SELECT count(*) FROM runs").fetchone()[0]
    except sqlite3.Error:
        return False
    return bool(revisions == 1 and experiments == 0 and runs == 0)


def _make_template(template: Path) -> bool:
    """Let MLflow create a store, drop its Default experiment, and keep it as `template`."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    for noisy in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    template.parent.mkdir(parents=True, exist_ok=True)
    scratch = template.with_name(f".{template.name}.{os.getpid()}.tmp")
    try:
        store = SqlAlchemyStore(f"{_PREFIX}{scratch}", str(template.parent / "artifacts"))  # type: ignore[no-untyped-call]  # mlflow: untyped
        store.engine.dispose()
        with contextlib.closing(sqlite3.connect(scratch)) as db:
            db.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")
            db.commit()
        if not _usable(scratch):
            return False
        os.replace(scratch, template)  # atomic: a concurrent maker's template is as good
        return True
    finally:
        scratch.unlink(missing_ok=True)


def seed_sqlite_store(uri: str) -> bool:
    """Create the SQLite store of `uri` from the template (made first if missing) when
    its file does not exist yet; whether it did. Never raises: MLflow then creates it."""
    if os.environ.get("MLFLOW_ENABLE_WORKSPACES"):
        return False  # a multi-workspace store: left to MLflow
    path = _store_file(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        template = template_path()
        if template is None:
            return False
        if not _usable(template) and not _make_template(template):
            return False
        scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(template, scratch)
            os.link(scratch, path)  # never replaces a store another process created meanwhile
        finally:
            scratch.unlink(missing_ok=True)
    except Exception:  # an optimisation only: MLflow creates the store as before
        return False
    return True
