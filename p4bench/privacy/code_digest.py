"""A digest of all the code that could have run for a plugin, for caches of verdicts on it.

`code_digest(obj)` hashes every file of the plugin that defines `obj` (a class or a
module), not only the file defining it: a method whose helper module changes (say, to send
a tenth of its private model) must not keep a verdict cached for the code it had before.

What is hashed, for the top-level package `top` of `obj`'s module:

- every file of each installed distribution that provides `top` (`importlib.metadata`:
  the `RECORD` of a regular install, metadata included), where the distribution holds the
  module defining `obj` (an unrelated distribution that also declares `top` is left out);
- every file of the source tree `top` is imported from (editable installs: setuptools'
  `__editable__` finder mapping, `.pth` path entries; `top.__path__`, and the `__path__`
  of every imported subpackage that lies elsewhere): every file, data files too, but not
  `__pycache__`, `*.pyc`, dot-folders, `*.egg-info` or a virtual environment. A plugin that
  is no distribution's (a test module, `__main__`, a folder on `sys.path`) is hashed so:
  its package folder, or its module file alone;
- always p4bench's version and the same digest of p4bench's own code: a change of the
  host can change what an outside method does.

An object with no file at all (defined in an interactive session, built with `type()`)
gets a digest marked "no-source" in what is hashed, over the byte code of its functions.
`code_digest` never raises: should hashing fail, it returns a digest no call repeats (a
verdict keyed on it is never found again, so it is checked again).

Calls after a process's first are cheap: the files are listed (a walk, a `stat` each) and
hashed again only where their stamp (paths, mtimes, sizes, inodes) changed or a file is
younger than two seconds (an edit within the file system's clock tick keeps the stamp).
"""

from __future__ import annotations

import ast
import csv
import hashlib
import importlib.metadata as metadata
import importlib.util
import inspect
import json
import marshal
import os
import sys
import time
import types
from collections.abc import Iterable, Iterator
from functools import lru_cache
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Any, NamedTuple

from p4bench.version import __version__

__all__ = ["FORMAT", "NO_SOURCE", "clear_cache", "code_digest", "code_files"]

FORMAT = 1  # bumped when what is hashed changes: every digest changes with it
NO_SOURCE = "no-source"
HOST = "p4bench"
_RACY_NS = 2_000_000_000  # a file younger than this may change again without a new stamp
_SKIP_FILES = (".pyc", ".pyo", ".swp", "~")


class _File(NamedTuple):
    label: str  # what the digest names it by: independent of where the tree is checked out
    path: str
    mtime_ns: int
    size: int
    inode: int


def code_digest(obj: type | types.ModuleType) -> str:
    """24 hex characters of sha256 over the code of `obj`'s plugin and of p4bench (module docstring)."""
    try:
        host = sys.modules.get(HOST)
        parts: dict[str, Any] = {
            "format": FORMAT,
            "host": [__version__, _package_code(*_locate(host or HOST))],
            "plugin": _plugin_code(obj),
        }
    except Exception as error:  # never raise: a digest that no later call repeats
        parts = {"format": FORMAT, "error": type(error).__name__, "nonce": os.urandom(16).hex()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def code_files(obj: type | types.ModuleType) -> list[Path]:
    """The files whose contents `code_digest(obj)` hashes for `obj`'s plugin (p4bench's own
    are hashed too, as the host); empty where `obj` has no source file."""
    top, own = _locate(obj)
    return [Path(f.path) for f in _collect(top, own)[1]]


def clear_cache() -> None:
    """Forget the hashed contents and the distributions found (tests; a process that
    replaced files keeping their stamps)."""
    _content_digest.cache_clear()
    _TOP_LEVELS.clear()


def _plugin_code(obj: object) -> dict[str, Any]:
    top, own = _locate(obj)
    code = _package_code(top, own)
    if code is None:
        return {"top": top, "code": NO_SOURCE, "bytecode": _bytecode_digest(obj)}
    return {"top": top, "code": code}


def _locate(obj: object) -> tuple[str, str | None]:
    """`obj`'s top-level package and the file of its module (None where it has none)."""
    if isinstance(obj, str):
        return obj, None
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    name = name if isinstance(name, str) and name else "__main__"
    module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if name == "__main__" and isinstance(spec, ModuleSpec) and spec.name != "__main__":
        name = spec.name  # `python -m package.module`: the package's code is the plugin's
    file = getattr(module, "__file__", None)
    return name.partition(".")[0], os.path.realpath(file) if isinstance(file, str) else None


def _package_code(top: str, own: str | None) -> dict[str, Any] | None:
    dists, files = _collect(top, own)
    if not files:
        return None
    if max(f.mtime_ns for f in files) > time.time_ns() - _RACY_NS:
        content = _content_digest.__wrapped__(files)  # too young to trust its stamp
    else:
        content = _content_digest(files)
    return {"distributions": dists, "files": len(files), "content": content}


def _collect(top: str, own: str | None) -> tuple[list[list[str]], tuple[_File, ...]]:
    """The distributions [name, version] of `top` that hold `own`, and every file of them
    and of the folders `top` is imported from, sorted by label."""
    roots: list[tuple[str, str]] = []  # (label, path) of a folder or a file
    listed: list[tuple[str, str]] = []
    dists: list[list[str]] = []
    for provider in _TOP_LEVELS.providers(top):
        if own is not None and own not in provider.paths and not _under(own, provider.roots):
            continue  # declares `top`, but the module was not imported from it
        if [provider.name, provider.version] not in dists:
            dists.append([provider.name, provider.version])
        listed += provider.files
        roots += provider.roots
    roots += _import_roots(top)
    if own is not None and not _under(own, roots) and not any(path == own for _, path in listed):
        roots.append((f"{top}:{Path(own).name}", own))
    seen: set[str] = set()
    found: list[_File] = []
    for label, path in [*listed, *_walk(roots)]:
        if path not in seen:
            seen.add(path)
            found.append(_File(label, path, *_stat(path)))
    return dists, tuple(sorted(found, key=lambda f: (f.label, f.path)))


class _Provider(NamedTuple):
    """What a distribution that declares a top-level name installed: read once per state of sys.path."""

    name: str
    version: str
    files: list[tuple[str, str]]  # (label, real path) of what its installer wrote
    paths: frozenset[str]
    roots: list[tuple[str, str]]  # an editable install's folders, of each of its top-level names

    @classmethod
    def of(cls, dist: metadata.Distribution) -> _Provider:
        name, base = str(dist.metadata["Name"] or "?"), Path(str(dist.locate_file("")))
        files = [
            (f"{name}:{f.as_posix()}", os.path.realpath(str(base / f)))
            for f in _installed_files(dist)
        ]
        files = [(label, path) for label, path in files if not _skipped_file(Path(path).name)]
        roots = list(_editable_roots(dist, base, sorted(_top_level_names(dist))))
        return cls(name, str(dist.version), files, frozenset(p for _, p in files), roots)


def _installed_files(dist: metadata.Distribution) -> list[metadata.PackagePath]:
    """The files an installer wrote (RECORD, installed-files.txt), not an egg-info's
    SOURCES.txt: that one lists a source checkout's files (tests, README), its code is
    imported from the folders found for the import name."""
    if dist.read_text("RECORD") is None and dist.read_text("installed-files.txt") is None:
        return []
    return list(dist.files or ())


def _editable_roots(
    dist: metadata.Distribution, base: Path, tops: list[str]
) -> Iterator[tuple[str, str]]:
    """Where an editable install imports its top-level names from: setuptools' finder
    mapping (with the package-dir mapping of subpackages), or a `.pth` file's path entries."""
    for file in dist.files or ():
        if file.name.startswith("__editable__") and file.name.endswith("_finder.py"):
            for key, value in _finder_mapping(base / file).items():
                yield from (
                    (key, os.path.realpath(v))
                    for v in ([value] if isinstance(value, str) else value)
                )
        elif file.suffix == ".pth":
            entries = [line.strip() for line in _text(base / file).splitlines()]
            paths = [
                str(base / e)
                for e in entries
                if e and not e.startswith(("#", "import ", "import\t"))
            ]
            for top in tops if paths else ():
                yield from _spec_roots(top, PathFinder.find_spec(top, paths))


def _finder_mapping(path: Path) -> dict[str, str | list[str]]:
    """MAPPING and NAMESPACES of a setuptools editable finder, read without running it."""
    found: dict[str, str | list[str]] = {}
    try:
        body = ast.parse(_text(path)).body
    except (SyntaxError, ValueError):
        body = []
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("MAPPING", "NAMESPACES"):
            try:
                mapping = ast.literal_eval(value)
            except ValueError:
                continue
            if isinstance(mapping, dict):
                found.update({str(k): v for k, v in mapping.items() if isinstance(v, str | list)})
    return found


def _import_roots(top: str) -> list[tuple[str, str]]:
    """The folders (or file) Python imports `top` from, and those of its imported
    subpackages and modules that lie elsewhere (a package-dir mapping, a patched __path__)."""
    module = sys.modules.get(top)
    if module is not None:
        roots = list(_module_roots(top, module))
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        roots = list(_spec_roots(top, spec))
    for name, sub in sorted(
        (n, m) for n, m in list(sys.modules.items()) if n.startswith(top + ".")
    ):
        roots += [
            (label, path) for label, path in _module_roots(name, sub) if not _under(path, roots)
        ]
    return roots


def _module_roots(name: str, module: object) -> Iterator[tuple[str, str]]:
    paths = getattr(module, "__path__", None)
    if paths is not None:
        try:
            yield from [(name, os.path.realpath(p)) for p in list(paths) if isinstance(p, str)]
        except TypeError:
            pass
    else:
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            yield f"{name}:{Path(file).name}", os.path.realpath(file)


def _spec_roots(name: str, spec: ModuleSpec | None) -> Iterator[tuple[str, str]]:
    if spec is None:
        return
    if spec.submodule_search_locations is not None:
        yield from ((name, os.path.realpath(p)) for p in spec.submodule_search_locations)
    elif spec.has_location and spec.origin:
        yield f"{name}:{Path(spec.origin).name}", os.path.realpath(spec.origin)


def _walk(roots: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """(label, path) of every file under the folders (or the files themselves) of `roots`;
    a root inside an earlier one is walked with it."""
    walked: list[tuple[str, str]] = []
    for label, root in roots:
        if _under(root, walked):
            continue
        walked.append((label, root))
        if os.path.isfile(root):
            yield label, root
            continue
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if not _skipped_folder(folder, d))
            relative = Path(os.path.relpath(folder, root)).as_posix()
            prefix = label if relative == "." else f"{label}/{relative}"
            yield from (
                (f"{prefix}/{name}", os.path.join(folder, name))
                for name in sorted(names)
                if not _skipped_file(name)
            )


def _skipped_folder(parent: str, name: str) -> bool:
    return (
        name == "__pycache__"
        or name.startswith(".")
        or name.endswith(".egg-info")
        or os.path.exists(os.path.join(parent, name, "pyvenv.cfg"))
    )


def _skipped_file(name: str) -> bool:
    return name.endswith(_SKIP_FILES) or name.startswith(".#")


def _under(path: str, roots: Iterable[tuple[str, str]]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for _, root in roots)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _stat(path: str) -> tuple[int, int, int]:
    try:
        status = os.stat(path)
        return status.st_mtime_ns, status.st_size, status.st_ino
    except OSError:
        return -1, -1, -1


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


@lru_cache(maxsize=256)
def _content_digest(files: tuple[_File, ...]) -> str:
    """sha256 over each file's label and contents: cached per stamp (the files' labels,
    paths, mtimes, sizes and inodes)."""
    digest = hashlib.sha256()
    for file in files:
        content = _read(file.path)
        digest.update(file.label.encode() + b"\0")
        digest.update(hashlib.sha256(content).digest() if content is not None else b"missing")
    return digest.hexdigest()


def _bytecode_digest(obj: object) -> str:
    """For an object without a file: the byte code of its functions and its plain values
    (a class redefined with another body gets another digest)."""
    digest = hashlib.sha256(
        f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}".encode()
    )
    for name, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        for part in (
            getattr(value, "__func__", value),
            *(getattr(value, a, None) for a in ("fget", "fset", "fdel")),
        ):
            code = getattr(part, "__code__", None)
            if isinstance(code, types.CodeType):
                digest.update(name.encode() + b"\0" + marshal.dumps(code))
        if isinstance(
            value, int | float | str | bytes | tuple | frozenset | type(None)
        ) and not name.startswith("__"):
            digest.update(f"{name}={value!r}".encode())
    return digest.hexdigest()


class _TopLevels:
    """Top-level import name -> the distributions that declare it, found once per state of
    `sys.path` (its entries and their mtimes: an install into one changes it)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[str, int], ...] | None = None
        self._mapping: dict[str, list[metadata.Distribution]] = {}
        self._providers: dict[str, list[_Provider]] = {}

    def clear(self) -> None:
        self._key, self._mapping, self._providers = None, {}, {}

    def providers(self, top: str) -> list[_Provider]:
        key = tuple((entry, _stat(entry or ".")[0]) for entry in sys.path)
        if key != self._key:
            self._mapping, self._providers = self._scan(), {}
            young = any(mtime > time.time_ns() - _RACY_NS for _, mtime in key)
            self._key = None if young else key
        if top not in self._providers:
            self._providers[top] = [_Provider.of(dist) for dist in self._mapping.get(top, ())]
        return self._providers[top]

    @staticmethod
    def _scan() -> dict[str, list[metadata.Distribution]]:
        mapping: dict[str, list[metadata.Distribution]] = {}
        seen: set[str] = set()
        for dist in metadata.distributions():
            where = str(getattr(dist, "_path", id(dist)))  # the same folder twice on sys.path
            if where not in seen:
                seen.add(where)
                for top in sorted(_top_level_names(dist)):
                    mapping.setdefault(top, []).append(dist)
        return mapping


def _top_level_names(dist: metadata.Distribution) -> set[str]:
    """As `importlib.metadata.packages_distributions`: top_level.txt, else the names of the
    files (a RECORD is read only then: it is what costs); and for an editable install, the
    packages its finder maps."""
    names = set((dist.read_text("top_level.txt") or "").split())
    if not names or _editable(dist):
        record = dist.read_text("RECORD")
        paths = (
            [row[0] for row in csv.reader(record.splitlines()) if row]
            if record
            else [str(f) for f in dist.files or ()]
        )
        if not names:
            names = {
                p.split("/", 1)[0] if "/" in p else inspect.getmodulename(p) or "" for p in paths
            }
        base = Path(str(dist.locate_file("")))
        for path in paths:
            name = path.rsplit("/", 1)[-1]
            if name.startswith("__editable__") and name.endswith("_finder.py"):
                names |= {key.partition(".")[0] for key in _finder_mapping(base / path)}
    return {name for name in names if name.isidentifier()}


def _editable(dist: metadata.Distribution) -> bool:
    """PEP 610's mark of an editable install (`pip install -e`)."""
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    info = direct.get("dir_info") if isinstance(direct, dict) else None
    return isinstance(info, dict) and info.get("editable") is True


_TOP_LEVELS = _TopLevels()
