"""Registers the built-in accountants (`p4bench privacy` is registered by `p4bench.cli.builtin`).
They are imported when the hook is called: building the plugin manager must not import scipy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.privacy.accountants import Accountant
    from p4bench.privacy.catalog import BUILTIN_ACCOUNTANTS

__all__ = ["Accountant", "BUILTIN_ACCOUNTANTS", "register_accountants"]

# the names this module used to import, for code that imports them from here
__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.privacy.accountants": ("Accountant",),
        "p4bench.privacy.catalog": ("BUILTIN_ACCOUNTANTS",),
    },
)


@hookimpl
def register_accountants() -> list[type[Accountant]]:
    from p4bench.privacy.catalog import BUILTIN_ACCOUNTANTS

    return list(BUILTIN_ACCOUNTANTS)
