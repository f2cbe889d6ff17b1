"""Lazy re-exports of a package (PEP 562): its public names are imported on first use.

The command line builds the plugin manager, and so imports every built-in plugin
package, on each start; `p4bench --help` must not pay for torch, scipy and the rest.
A package that re-exports names of its submodules lists them as

    if TYPE_CHECKING:  # what type checkers, readers and the import-graph test see
        from p4bench.engine.method import Method

    __all__ = ["Method"]
    __getattr__ = lazy_exports(globals(), {"p4bench.engine.method": ("Method",)})

and `from p4bench.engine import Method` imports `p4bench.engine.method` then.

`dir(package)` lists a name once it is imported, not before: older pluggy releases
(`pluggy>=1.3` is allowed) read every name `dir()` lists on a plugin module with
`getattr`, which would import them all when the plugin manager is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["LazyPackage", "lazy_exports", "package_getattr"]


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> Callable[[str], Any]:
    """A module `__getattr__` for the package whose `globals()` is `namespace`; `exports`
    maps a module to the names the package takes from it. A name is imported on first
    access and then kept in the package's namespace."""
    package = namespace["__name__"]
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


class LazyPackage:
    """A plugin package's names declared once: its `__all__` (`names`), its module
    `__getattr__` (`getattr`) and the classes its registration hook returns (`load`), all
    from one mapping of module -> names (the `lazy_exports` form)::

        PACKAGE = LazyPackage(globals(), {"p4bench_attacks.gaussian": ("Gaussian",), ...})
        __all__ = PACKAGE.names
        __getattr__ = PACKAGE.getattr

        @hookimpl
        def register_attacks():
            return PACKAGE.load()  # imported now, in the mapping's order

    Keep the `if TYPE_CHECKING:` imports beside it: type checkers and the import-graph
    test read those."""

    def __init__(self, namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]) -> None:
        self.names: list[str] = [name for names in exports.values() for name in names]
        self.getattr = lazy_exports(namespace, exports)
        self._namespace = namespace

    def load(self) -> list[Any]:
        """Every exported object, imported now, in declaration order."""
        return [
            self._namespace[name] if name in self._namespace else self.getattr(name)
            for name in self.names
        ]


def package_getattr(*packages: LazyPackage) -> Callable[[str], Any]:
    """One module `__getattr__` for a module that declares several `LazyPackage`s (one per
    registration hook)."""

    def __getattr__(name: str) -> Any:
        for package in packages:
            if name in package.names:
                return package.getattr(name)
        raise AttributeError(
            f"module {packages[0]._namespace['__name__']!r} has no attribute {name!r}"
        )

    return __getattr__
