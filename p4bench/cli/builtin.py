"""Registers the built-in command groups through the public `register_commands` hook,
as a third-party plugin would: `data`, `privacy`, `topology`, `audit`, `impact` and the
studies (`sweep`, `tune`, `compare`, `reproduce`). `run` and `list` are the app's own
(`p4bench.cli.build_app`).

Library modules never import command code; this module is listed in
`p4bench.host.manager.BUILTIN_MODULES` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    import typer


@hookimpl
def register_commands(app: typer.Typer) -> None:
    # imported here: building the plugin manager must not load every command module
    from p4bench.cli import audit, data, impact, privacy, studies, topology

    for commands in (studies, topology, audit, privacy, impact, data):
        commands.register(app)
