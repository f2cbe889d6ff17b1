"""Registers the `p4bench audit` command."""

from p4bench.hookspecs import hookimpl


@hookimpl
def register_commands(app):
    from p4bench.audit.cli import register  # typer is only needed when the CLI is built

    register(app)
