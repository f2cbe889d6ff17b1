"""Shell completion of plugin names (`--method`, `--attack`, ...), fast enough for a TAB.

Building the plugin registry imports every plugin (torch among them): seconds. The names
are cached instead, in `~/.cache/p4bench/plugin-names.json` (or `$P4BENCH_CACHE_DIR`), under
a fingerprint of the installed p4bench plugin distributions (their entry points and
versions, read from package metadata without importing them): a TAB reads the cache; a
changed set of plugins, or no cache yet, builds the registry once and writes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["completer", "plugin_names"]


def _cache_file() -> Path:
    root = os.environ.get("P4BENCH_CACHE_DIR") or Path.home() / ".cache" / "p4bench"
    return Path(root) / "plugin-names.json"


def _fingerprint() -> str:
    """The installed plugin distributions (entry points of group p4bench, with versions)."""
    from importlib.metadata import entry_points

    from p4bench.version import __version__

    points = sorted(f"{p.name}={p.value}@{getattr(p.dist, 'version', '?')}" for p in entry_points(group="p4bench"))
    return hashlib.sha256(json.dumps([__version__, points]).encode()).hexdigest()[:16]


def plugin_names(kind: str) -> list[str]:
    """The registered plugin names of `kind` (from the cache when it matches the installed
    plugins; else from the registry, which is then cached). Empty on any failure: a TAB
    must never print a traceback."""
    try:
        path, key = _cache_file(), _fingerprint()
        try:
            cached = json.loads(path.read_text())
            if cached.get("fingerprint") == key:
                return list(cached["names"].get(kind, []))
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        from p4bench.plugin_manager import KINDS, default_registry

        registry = default_registry()
        names = {k: registry.names(k) for k in KINDS}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fingerprint": key, "names": names}))
        except OSError:
            pass  # a read-only home: complete without caching
        return list(names.get(kind, []))
    except Exception:  # noqa: BLE001 - completion shows nothing rather than an error
        return []


def completer(kind: str) -> Callable[[str], list[str]]:
    """A typer `autocompletion` callback offering the `kind` names that start with what is typed."""

    def complete(incomplete: str) -> list[str]:
        return [name for name in plugin_names(kind) if name.startswith(incomplete)]

    return complete
