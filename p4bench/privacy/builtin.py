"""Registers the built-in accountants (`p4bench privacy` is registered by `p4bench.cli.builtin`)."""

from p4bench.hookspecs import hookimpl
from p4bench.privacy import BUILTIN_ACCOUNTANTS, Accountant


@hookimpl
def register_accountants() -> list[type[Accountant]]:
    return list(BUILTIN_ACCOUNTANTS)
