"""Registers the built-in accountants and the `p4bench privacy` commands."""

from p4bench.hookspecs import hookimpl
from p4bench.privacy import BUILTIN_ACCOUNTANTS


@hookimpl
def register_accountants():
    return list(BUILTIN_ACCOUNTANTS)


@hookimpl
def register_commands(app):
    from p4bench.privacy.cli import register  # typer is only needed when the CLI is built

    register(app)
