"""The plugin listing, cached for the commands that only show names: `list` and shell
completion.

Building the registry imports every plugin, torch among them (1.4 s of `import torch` on a
2-core machine, more than `p4bench list`'s 1.5 s target). What `list` shows is the
registry's listing (`Registry.as_dict`: names, distributions, versions, descriptions and
the problems of installed plugins), which changes only when a plugin's code does. So it
is cached in the derived-data cache (`$P4BENCH_CACHE_DIR`, default
`~/.cache/p4bench/data/cache`, `p4bench.data.paths.cache_dir`) under a fingerprint of
everything it comes from: p4bench's version, the installed distributions' p4bench entry
points and versions, and the size and modification time of every Python file of the
built-in plugin packages and of each entry point's top-level package (found without
importing it). A changed file, plugin or version builds the registry again and rewrites
the cache. `P4BENCH_NO_PLUGIN_CACHE=1` always builds it.

The cache also records which installed distributions add commands (`register_commands`):
while it is current and says none do, building the command line (`--help`, every
command) imports no installed plugin (`only_builtin_commands`).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any

__all__ = ["cached_listing", "fingerprint", "only_builtin_commands"]

_FILE = "plugin-listing.json"


def _cache_file() -> Path:
    from p4bench.data.paths import cache_dir

    return cache_dir() / _FILE


def _package_dirs(names: list[str]) -> set[Path]:
    """The folders of these modules' packages, located without importing a module whose
    package is not yet imported beyond its parents (`find_spec` imports parents only)."""
    folders: set[Path] = set()
    for name in names:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            folders.update(Path(p) for p in spec.submodule_search_locations)
        elif spec.origin:
            folders.add(Path(spec.origin).parent)
    return folders


def _files_state(folders: set[Path]) -> list[str]:
    """`path:size:mtime_ns` of every Python file below the folders (no caches, no venvs)."""
    rows = []
    for folder in sorted(folders):
        for root, dirs, files in os.walk(folder):
            dirs[:] = [
                d
                for d in dirs
                if not d.startswith(".") and d != "__pycache__" and d != "site-packages"
            ]
            for name in files:
                if name.endswith(".py"):
                    stat = os.stat(os.path.join(root, name))
                    rows.append(f"{os.path.join(root, name)}:{stat.st_size}:{stat.st_mtime_ns}")
    return sorted(rows)


def fingerprint() -> str:
    """What the listing depends on (module docstring), hashed."""
    from importlib.metadata import entry_points

    from p4bench.host.manager import BUILTIN_MODULES
    from p4bench.version import __version__

    points = sorted(entry_points(group="p4bench"), key=lambda p: (p.name, p.value))
    described = [f"{p.name}={p.value}@{getattr(p.dist, 'version', '?')}" for p in points]
    modules = [*BUILTIN_MODULES, "p4bench", *(p.value.split(":")[0].split(".")[0] for p in points)]
    autoload = os.environ.get("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "")
    state = [__version__, autoload, described, _files_state(_package_dirs(modules))]
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()[:16]


def cached_listing() -> tuple[dict[str, Any], str]:
    """(the registry's listing (`Registry.as_dict`), its fingerprint): from the cache when
    the fingerprint is current, else from the registry (then cached; a cache that cannot
    be written is skipped)."""
    key = fingerprint()
    if os.environ.get("P4BENCH_NO_PLUGIN_CACHE") or _registered_in_code():
        return _build(), key
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and cached.get("fingerprint") == key:
            return dict(cached["listing"]), key
    except (OSError, ValueError, KeyError, TypeError):
        pass
    listing = _build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(
            json.dumps(
                {"fingerprint": key, "listing": listing, "command_plugins": _command_plugins()}
            )
        )
        temporary.replace(path)  # a concurrent reader sees the old file or the new one, never half
    except OSError:
        pass
    return listing, key


def only_builtin_commands() -> bool:
    """Whether the current cached listing says no installed plugin adds commands (False
    when the cache is missing, stale or off: then the plugins are loaded to ask them)."""
    if os.environ.get("P4BENCH_NO_PLUGIN_CACHE"):
        return False
    try:
        cached = json.loads(_cache_file().read_text())
        return bool(
            cached.get("command_plugins") == [] and cached.get("fingerprint") == fingerprint()
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def _command_plugins() -> list[str]:
    """The installed distributions whose plugins implement `register_commands`."""
    from p4bench.host.manager import default_plugin_manager, source_of

    manager = default_plugin_manager()
    return sorted(
        {
            source_of(manager, impl.plugin_name).distribution
            for impl in manager.hook.register_commands.get_hookimpls()
            if not source_of(manager, impl.plugin_name).strict
        }
    )


def _registered_in_code() -> bool:
    """Whether plugins were registered on the process-wide manager in code (tests, a
    program embedding p4bench): the fingerprint knows only installed ones."""
    from p4bench.host.manager import default_plugin_manager

    manager = default_plugin_manager()
    return any(name not in manager.sources for name, _ in manager.list_name_plugin())


def _build() -> dict[str, Any]:
    from p4bench.host.manager import default_registry

    return default_registry().as_dict()
