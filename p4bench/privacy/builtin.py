"""Registers the built-in accountants (`p4bench privacy` is registered by `p4bench.cli.builtin`).
They are imported when the hook is called: building the plugin manager must not import scipy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.privacy.accountants import Accountant


@hookimpl
def register_accountants() -> list[type[Accountant]]:
    from p4bench.privacy.catalog import BUILTIN_ACCOUNTANTS

    return list(BUILTIN_ACCOUNTANTS)
