"""Checks of the paths a run, a study or a plot will write, made before any training:
a folder that cannot be created or written, a file where a folder is expected, a full
disk or an SQLite tracking store whose folder cannot be made becomes a `UsageError`
(one line, exit 2) instead of a traceback minutes later.

Only the file system is consulted: MLflow is not opened (slow), servers are not contacted
(the tracker copes with an unreachable server and keeps the results locally). The folders
a run writes to are created here, as the run itself would a moment later; a plot's folder
is only probed (nothing is left behind when the command fails later for another reason).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from p4bench.errors import UsageError
from p4bench.tracking.stores import sqlite_path  # re-exported: it was defined here

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = [
    "MIN_FREE_BYTES",
    "PLOT_SUFFIXES",
    "check_run_paths",
    "check_paths",
    "check_study_paths",
    "check_tracking_uri",
    "check_writable_dir",
    "check_output_file",
    "check_plot_path",
    "sqlite_path",
]

MIN_FREE_BYTES = 1 << 20  # a run's local copy and store rows need more than this
PLOT_SUFFIXES = (
    "",
    ".png",
    ".pdf",
    ".svg",
    ".svgz",
    ".eps",
    ".ps",
    ".jpg",
    ".jpeg",
    ".tif",
    ".tiff",
    ".webp",
    ".pgf",
    ".raw",
    ".rgba",
)  # matplotlib's savefig formats; no suffix means PNG


def check_run_paths(config: RunConfig) -> None:
    """The run's results folder and its tracking store can be created and written."""
    check_paths(config.results_dir, config.tracking_uri)


def check_study_paths(results_dir: str | None, tracking_uri: str | None) -> None:
    """A study's check before any run: a named tracking server answers (first: a refused study
    leaves no folder behind), then `check_paths`."""
    from p4bench.tracking.links import check_study_server

    check_study_server(results_dir, tracking_uri)
    check_paths(results_dir, tracking_uri)


def check_paths(results_dir: str | Path | None, tracking_uri: str | None) -> None:
    """`results_dir` (default: RunConfig's) can be created and written, and so can the
    folder of the tracking store: `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else the
    SQLite store inside `results_dir` (as the tracker derives it)."""
    from p4bench.config import RunConfig
    from p4bench.tracking.stores import default_tracking_uri

    folder = str(results_dir or RunConfig.results_dir)
    check_writable_dir(folder, "results folder")
    check_tracking_uri(tracking_uri or default_tracking_uri(folder))


# The tracking store schemes MLflow accepts (its tracking store registry, and its database
# engines with an optional "+driver"); tests/test_preflight.py checks them against MLflow's.
TRACKING_SCHEMES = (
    "",
    "file",
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "http",
    "https",
    "databricks",
    "databricks-uc",
    "uc",
)


def check_tracking_uri(uri: str) -> None:
    """A tracking URI MLflow accepts: a known scheme (a mistyped one is one clear line, not
    MLflow's traceback); a local store (SQLite file, `file:` URI or plain path) can be
    created and written; remote stores (http, databases) are left to the tracker."""
    scheme = urlsplit(uri).scheme.lower()
    if (
        len(scheme) > 1 and scheme.split("+", 1)[0] not in TRACKING_SCHEMES
    ):  # one letter: a Windows drive
        known = ", ".join(f"{s}:" for s in TRACKING_SCHEMES if s)
        raise UsageError(
            f"tracking URI {uri!r}: unknown scheme {scheme + ':'!r}; MLflow accepts a folder or "
            f"{known} (e.g. sqlite:///runs/mlflow.db or http://127.0.0.1:5000)"
        )
    database = sqlite_path(uri)
    if database is not None:
        if database.is_dir():
            raise UsageError(
                f"cannot use the MLflow store {uri}: {database} is a folder, not a database file"
            )
        check_writable_dir(
            database.parent,
            "MLflow store folder",
            subject=f"the MLflow store {uri} (folder {database.parent})",
        )
        if database.exists() and not os.access(database, os.R_OK | os.W_OK):
            raise UsageError(
                f"cannot write the MLflow store {uri}: permission denied on {database}"
            )
        return
    parts = urlsplit(uri)
    if (
        parts.scheme == "file" or len(parts.scheme) <= 1
    ):  # a folder: MLflow's file store (or a Windows path)
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
            raise UsageError(
                f"tracking URI {uri!r} is a folder store, which MLflow 3 no longer writes: use a "
                "database such as sqlite:///runs/mlflow.db (or set MLFLOW_ALLOW_FILE_STORE=true)"
            )
        folder = unquote(parts.path) if parts.scheme == "file" else uri
        check_writable_dir(folder, "MLflow store folder", subject=f"the MLflow store {uri}")


def check_writable_dir(
    path: str | Path, what: str, *, create: bool = True, subject: str | None = None
) -> Path:
    """`path` is (or can be made) a folder we can write into, on a device with space left.
    With `create` the missing folders are made (as the caller is about to); without, only
    the nearest existing folder is probed and nothing is left behind. Messages name "the
    `what` `path`" ("the results folder p4bench-runs"), or `subject` when given."""
    folder = Path(path).expanduser()
    subject = subject or f"the {what} {folder}"
    existing = folder
    while not existing.is_dir():
        if existing.exists() or existing.is_symlink():
            raise UsageError(f"cannot create {subject}: {existing} is a file, not a folder")
        if existing.parent == existing:
            break
        existing = existing.parent
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
            probe_in = folder
        else:
            probe_in = Path(tempfile.mkdtemp(prefix=".p4bench-check-", dir=existing))
        handle, name = tempfile.mkstemp(prefix=".p4bench-check-", dir=probe_in)
        os.close(handle)
        os.unlink(name)
        if not create:
            probe_in.rmdir()
    except OSError as exc:
        verb = "write" if folder.is_dir() else "create"
        raise UsageError(f"cannot {verb} {subject}: {_reason(exc)}") from None
    _check_free_space(folder if folder.is_dir() else existing, subject)
    return folder


def _check_free_space(on: Path, subject: str) -> None:
    try:
        stats = os.statvfs(on)
    except (
        OSError,
        AttributeError,
    ):  # no statvfs (Windows) or an odd file system: let writing tell
        return
    free = stats.f_bavail * stats.f_frsize
    if stats.f_blocks and free < MIN_FREE_BYTES:
        raise UsageError(
            f"no space left for {subject}: {free:,} bytes free on its device "
            "([Errno 28] No space left on device)"
        )


def check_output_file(path: str | Path, what: str) -> Path:
    """A file the command will write: not a folder, and its folder can be made and written
    (probed, nothing created)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UsageError(f"cannot write the {what} {file}: it is a folder")
    check_writable_dir(
        file.parent, f"folder of the {what}", create=False, subject=f"the {what} {file}"
    )
    if file.exists() and not os.access(file, os.W_OK):
        raise UsageError(f"cannot write the {what} {file}: permission denied")
    return file


def check_plot_path(path: str | Path) -> Path:
    """`check_output_file` for an image matplotlib saves, with a format it knows."""
    file = Path(path)
    if file.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(
            f"cannot save a plot as {file}: unknown image format '{file.suffix}'; "
            f"use one of {', '.join(s for s in PLOT_SUFFIXES if s)}"
        )
    return check_output_file(file, "plot")


def _reason(exc: OSError) -> str:
    return (
        f"[Errno {exc.errno}] {exc.strerror}"
        if exc.errno is not None and exc.strerror
        else str(exc)
    )
