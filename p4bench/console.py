"""The `p4bench` console script: `p4bench.cli.main` behind a guard for Ctrl-C while the
command line itself is imported.

`p4bench.cli.main` turns an interrupt into one line and exit 130 once it runs; the script
imports it first (typer, rich and p4bench's errors: about 0.1 s), and Ctrl-C then would
print the import's traceback. This module imports nothing but the package root, so only
the interpreter's own start-up is left unguarded.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

INTERRUPT_EXIT = 130  # as p4bench.cli.INTERRUPT_EXIT


def main() -> None:
    """Entry point of the `p4bench` script (pyproject.toml's [project.scripts])."""
    try:
        from p4bench.cli import main as cli_main
    except (
        KeyboardInterrupt
    ):  # rich may not be imported yet: a plain line, as the command line's own
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        sys.exit(INTERRUPT_EXIT)
    cli_main()
