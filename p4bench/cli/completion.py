"""Shell completion of plugin names (`--method`, `--attack`, ...), fast enough for a TAB:
the names come from the cached plugin listing (`p4bench.cli.plugin_cache`), so a TAB
imports no plugin once the cache is current."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["completer", "plugin_names"]


def plugin_names(kind: str) -> list[str]:
    """The registered plugin names of `kind`; empty on any failure (a TAB must never print
    a traceback)."""
    try:
        from p4bench.cli.plugin_cache import cached_listing

        listing, _ = cached_listing()
        return [entry["name"] for entry in listing.get(kind, [])]
    except Exception:  # noqa: BLE001 - completion shows nothing rather than an error
        return []


def completer(kind: str) -> Callable[[str], list[str]]:
    """A typer `autocompletion` callback offering the `kind` names that start with what is typed."""

    def complete(incomplete: str) -> list[str]:
        return [name for name in plugin_names(kind) if name.startswith(incomplete)]

    return complete
