"""The `p4bench` command line: thin adapters over library functions.

Every `P4BenchError` becomes one red line on stderr and the error's exit code (2 for
bad input), in `main` only.
"""

from __future__ import annotations

import sys
import weakref

import typer
from rich.console import Console

from p4bench.errors import P4BenchError

__all__ = ["build_app", "main", "warn_plugin_problems"]

err_console = Console(stderr=True)
_warned: weakref.WeakSet = weakref.WeakSet()  # registries whose problems were printed


def warn_plugin_problems() -> None:
    """Print each problem of an installed plugin as one yellow line on stderr, once per
    process (once per registry: tests that reset the registry see them again)."""
    from rich.markup import escape

    from p4bench.plugin_manager import default_registry

    registry = default_registry()
    if registry in _warned:
        return
    _warned.add(registry)
    for problem in registry.problems:
        err_console.print(f"[yellow]warning:[/yellow] {escape(problem.line())}", highlight=False, soft_wrap=True)


def build_app() -> typer.Typer:
    """The typer app with built-in commands and those plugins add via `register_commands`."""
    from p4bench.cli import describe, listing, run
    from p4bench.plugin_manager import add_plugin_commands, default_plugin_manager

    app = typer.Typer(
        name="p4bench",
        help="Benchmark differentially private, peer-to-peer, personalized learning methods.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    run.register(app)
    listing.register(app)
    describe.register(app)
    add_plugin_commands(default_plugin_manager(), app)  # a broken plugin's commands become a warning
    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `p4bench` script."""
    try:
        app = build_app()
        warn_plugin_problems()
        app(args=argv, prog_name="p4bench")
    except P4BenchError as exc:
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
