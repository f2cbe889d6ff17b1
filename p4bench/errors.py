"""One exception hierarchy; the CLI turns it into a one-line message and an exit code."""

from __future__ import annotations

import errno as _errno
import sys as _sys
from collections.abc import Iterable
from pathlib import Path as _Path
from types import FrameType as _FrameType
from types import TracebackType as _TracebackType


class P4BenchError(Exception):
    """Base class of every error p4bench reports to a user."""

    exit_code: int = 1


class PluginDeprecationWarning(DeprecationWarning):
    """A part of the plugin API (`p4bench.api`) that still works and will be removed; the
    command line shows it as one line (Python hides other DeprecationWarnings in plugins)."""


def deprecated(what: str, instead: str, removed_in: str, stacklevel: int = 3) -> None:
    """Warn that `what` is deprecated (since this API version) and what to do `instead`;
    `stacklevel` 3 names the caller of the function that calls this."""
    import warnings

    warnings.warn(
        f"{what} is deprecated since p4bench 0.2 and will be removed in {removed_in}: {instead}",
        PluginDeprecationWarning,
        stacklevel=stacklevel,
    )


class UsageError(P4BenchError):
    """Bad input from the user (config, options, names); exits with code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """An invalid configuration value, naming the field and the valid range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid value for '{field}': {message}")
        self.field = field


class UnknownNameError(UsageError):
    """A plugin name that is not registered; lists the registered names of that kind."""

    def __init__(self, kind: str, name: str, available: Iterable[str]) -> None:
        names = sorted(available)
        listed = ", ".join(names) if names else "(none registered)"
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        super().__init__(f"unknown {kind} '{name}'; registered {plural}: {listed}")
        self.kind, self.name, self.available = kind, name, names


class DuplicateNameError(UsageError):
    """Two plugins registered the same name for the same kind; exits with code 2."""


class PluginError(UsageError):
    """A plugin name whose registration is broken (not a class of its kind, ...)."""


class IncompatibleError(UsageError):
    """A combination of plugins that cannot run together (checked before training)."""


class DataError(UsageError):
    """Data that is missing, malformed or too small for the request."""


# -- failures that are not P4BenchError but still the user's (the CLI boundary) ----------
#
# `p4bench.cli.main` turns these into one line and exit 2, like a UsageError:
#
# - OSError: a path that cannot be created, read or written (missing folder, permission,
#   a file where a folder is expected, read-only or full disk), or a network failure
#   (connection refused, name not resolved, timeout). Library code raises OSError almost
#   only for such things, so every OSError that carries an errno or a file name counts,
#   with two exceptions that keep their traceback as bugs: a file name inside the
#   installed p4bench package or site-packages (a missing package file is a packaging bug,
#   not a user's path) and an OSError with neither errno nor file name (a library's own
#   message, e.g. an image encoder refusing a mode). The cost of the choice: a bug that
#   opens a wrong path of the user's reads as a user error; the line names the path, and
#   `P4BENCH_TRACEBACK=1` prints the traceback as well.
# - An unusable MLflow store: sqlite3 / SQLAlchemy OperationalError (locked, unable to
#   open, read-only), a file that is not a database, and MlflowException caused by one of
#   these or by an unreachable tracking server.
# - Invalid YAML (yaml.YAMLError) wherever it is read.
#
# Only modules already imported are consulted (sys.modules), so this costs no imports.

_PACKAGE_DIR = _Path(__file__).resolve().parent
_FULL_DISK = (_errno.ENOSPC, getattr(_errno, "EDQUOT", _errno.ENOSPC))
_CONNECTION = {
    getattr(_errno, name)
    for name in (
        "ECONNREFUSED",
        "ECONNRESET",
        "ECONNABORTED",
        "ETIMEDOUT",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
    )
    if hasattr(_errno, name)
}
_URI_NAMES = ("tracking_uri", "db_uri", "store_uri", "uri", "url")
_PATH_NAMES = ("path", "file", "config_file", "filename", "fname", "folder")


def user_error_line(exc: BaseException) -> str | None:
    """The line (without "error: ") a failure the user caused becomes, or None when `exc`
    is to be treated as a bug: a P4BenchError's message (one line for a UsageError; other
    P4BenchErrors keep theirs, e.g. a peer's log tail), or one line for the OS, store and
    YAML failures described above."""
    if isinstance(exc, P4BenchError):  # bad input is one line; other errors may carry a log tail
        message = _with_yaml_flattened(exc)
        return one_line(message) if isinstance(exc, UsageError) else message
    if _is_yaml_error(exc):
        return _yaml_line(exc)
    store = _store_line(exc)
    if store is not None:
        return store
    if isinstance(exc, OSError):
        return _os_error_line(exc)
    return None


def one_line(text: str) -> str:
    """`text` on one line: its non-blank lines stripped and joined by a space."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


# -- OS errors --------------------------------------------------------------------------


def _in_installation(path: str) -> bool:
    """Whether `path` lies in the installed p4bench package or in site-packages."""
    import sysconfig

    try:
        resolved = _Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    roots = {
        _PACKAGE_DIR,
        *(
            _Path(p).resolve()
            for k, p in sysconfig.get_paths().items()
            if k in ("purelib", "platlib")
        ),
    }
    return any(resolved.is_relative_to(root) for root in roots)


def _is_network(exc: OSError) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)) or exc.errno in _CONNECTION:
        return True
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    return bool(
        names
        & {
            "socket.gaierror",
            "socket.herror",
            "urllib.error.URLError",
            "requests.exceptions.RequestException",
            "urllib3.exceptions.HTTPError",
        }
    )


def _os_reason(exc: OSError) -> str:
    if exc.errno is not None and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    reason = getattr(exc, "reason", None)  # urllib.error.URLError
    return one_line(str(reason if reason is not None else exc)) or type(exc).__name__


def _os_error_line(exc: OSError) -> str | None:
    filename = exc.filename
    if filename is not None and not isinstance(filename, int) and _in_installation(str(filename)):
        return None  # a file of the installation itself: a packaging bug
    if _is_network(exc):
        where = _innermost_uri(exc.__traceback__)
        cause = _innermost_os_error(exc)
        return f"cannot connect{f' to {where}' if where else ''}: {_os_reason(cause)}"
    if exc.errno is None and filename is None:
        return None  # a library's own message, no path and no OS reason: treated as a bug
    reason = _os_reason(exc)
    if filename is None:
        found = _innermost_local(exc.__traceback__, _PATH_NAMES)
        filename = found[1] if found else None
    if exc.errno in _FULL_DISK:
        return (
            f"no space left to write {filename}: {reason}" if filename else f"disk full: {reason}"
        )
    if filename is None:
        return reason
    target = f"{filename} -> {exc.filename2}" if exc.filename2 is not None else str(filename)
    creating = _innermost_function(exc.__traceback__) in ("mkdir", "makedirs")
    verb = (
        "cannot create folder"
        if creating
        else ("cannot write" if exc.errno == _errno.EROFS else "cannot access")
    )
    return f"{verb} {target}: {reason}"


def _innermost_os_error(exc: BaseException) -> OSError:
    """The deepest OSError with an errno in `exc`'s chain of causes (else `exc`)."""
    found = exc
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno is not None:
            found = link
    return found  # type: ignore[return-value]


# -- stores ------------------------------------------------------------------------------


def _chain(exc: BaseException, limit: int = 20) -> list[BaseException]:
    """`exc`, then what caused it (`__cause__`, `__context__`, SQLAlchemy's `orig`)."""
    links: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in links and len(links) < limit:
        links.append(current)
        orig = getattr(current, "orig", None)
        current = (
            orig if isinstance(orig, BaseException) else (current.__cause__ or current.__context__)
        )
    return links


def _class_of(module: str, name: str) -> type | None:
    loaded = _sys.modules.get(module)
    found = getattr(loaded, name, None) if loaded is not None else None
    return found if isinstance(found, type) else None


def _is_db_error(exc: BaseException) -> bool:
    """An OperationalError (locked, unable to open, read-only), or a plain DatabaseError
    (not a database file), of sqlite3 or SQLAlchemy: never Integrity / Programming errors."""
    for module in ("sqlite3", "sqlalchemy.exc"):
        operational, database = (
            _class_of(module, "OperationalError"),
            _class_of(module, "DatabaseError"),
        )
        if operational is not None and isinstance(exc, operational):
            return True
        if database is not None and type(exc) is database:
            return True
    return False


def _store_line(exc: BaseException) -> str | None:
    mlflow_error = _class_of("mlflow.exceptions", "MlflowException")
    is_mlflow = mlflow_error is not None and isinstance(exc, mlflow_error)
    if not (is_mlflow or _is_db_error(exc)):
        return None
    links = _chain(exc)
    db = next((link for link in links if _is_db_error(link)), None)
    uri = _innermost_uri(exc.__traceback__)
    where = f"the MLflow store {uri}" if uri else "the MLflow store"
    if db is not None:
        cause = getattr(db, "orig", None) or db
        return (
            f"cannot use {where}: {one_line(str(cause).split(chr(10))[0])} ({type(cause).__name__})"
        )
    message = str(exc)
    if message.startswith("API request to") and "failed with exception" in message:
        server = message.split()[3]
        from urllib.parse import urlparse

        parsed = urlparse(server)
        server = f"{parsed.scheme}://{parsed.netloc}" if parsed.netloc else server
        cause = _innermost_os_error(exc)
        reason = _os_reason(cause) if isinstance(cause, OSError) else one_line(message)[:200]
        return f"cannot reach the MLflow tracking server {redact(server)}: {reason}"
    if "database schema" in message or "database migration" in message.lower():
        return f"cannot use {where}: {one_line(message)}"
    for link in links[1:]:
        if isinstance(link, OSError):
            line = _os_error_line(link)
            if line is not None:
                return f"cannot use {where}: {line}"
    return None


# -- YAML ----------------------------------------------------------------------------------


def _is_yaml_error(exc: BaseException) -> bool:
    yaml_error = _class_of("yaml", "YAMLError")
    return yaml_error is not None and isinstance(exc, yaml_error)


def yaml_reason(exc: BaseException) -> str:
    """A YAML error on one line: what went wrong and where (line, column)."""
    parts = [str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p]
    text = ": ".join(parts) if parts else one_line(str(exc))
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text


def _yaml_line(exc: BaseException) -> str:
    mark = getattr(exc, "problem_mark", None)
    source = getattr(mark, "name", None)
    if not source or source.startswith(
        "<"
    ):  # read from a string: the file or KEY=VALUE p4bench was reading
        found = _innermost_local(exc.__traceback__, (*_PATH_NAMES, "pair"), inside_package=True)
        source = None if found is None else repr(found[1]) if found[0] == "pair" else found[1]
    return f"invalid YAML{f' in {source}' if source else ''}: {yaml_reason(exc)}"


def _with_yaml_flattened(exc: P4BenchError) -> str:
    """The message, with the multi-line text of a YAML error it quotes made one line."""
    message = str(exc)
    for link in (exc.__cause__, exc.__context__):
        if link is not None and _is_yaml_error(link) and str(link) and str(link) in message:
            return message.replace(str(link), yaml_reason(link))
    return message


# -- where in the traceback ------------------------------------------------------------


def _frames(tb: _TracebackType | None) -> list[_FrameType]:
    frames: list[_FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]  # innermost first


def _innermost_function(tb: _TracebackType | None) -> str | None:
    frames = _frames(tb)
    return frames[0].f_code.co_name if frames else None


def _innermost_uri(tb: _TracebackType | None) -> str | None:
    """The first URI-like local (a str with `://`, or `self.db_uri` of an MLflow SQL
    store), from the innermost frame out."""
    for frame in _frames(tb):
        local = frame.f_locals
        try:
            store_uri = getattr(local.get("self"), "db_uri", None)
        except Exception:  # a property that fails: not a store
            store_uri = None
        for value in (store_uri, *(local.get(n) for n in _URI_NAMES)):
            if isinstance(value, str) and "://" in value:
                return redact(value)
    return None


def redact(uri: str) -> str:
    """`uri` with the password of its user info replaced by `***`."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        if parts.password is None:
            return uri
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    except ValueError:
        return uri


def _innermost_local(
    tb: _TracebackType | None, names: tuple[str, ...], *, inside_package: bool = False
) -> tuple[str, str] | None:
    """(name, value) of the first local variable named one of `names` holding a str or a
    path, from the innermost frame out (only p4bench's frames with `inside_package`)."""
    for frame in _frames(tb):
        if inside_package and not str(frame.f_globals.get("__name__", "")).startswith("p4bench"):
            continue
        for name in names:
            value = frame.f_locals.get(name)
            if isinstance(value, (str, _Path)) and str(value):
                return name, str(value)
    return None
