"""Whether this process is the `p4bench` script itself (its command ends the process).

Some start-up savings only pay where the command owns the process: `run` then starts
its MLflow writer as a second process (`p4bench.tracking.worker`), which a test or a
library caller invoking the app in-process (with its own MLflow already imported) does
not need.
"""

from __future__ import annotations

__all__ = ["console_script", "mark_console_script"]

_console_script = False


def mark_console_script() -> None:
    """Called by `p4bench.cli.main` when it runs as the console script."""
    global _console_script
    _console_script = True


def console_script() -> bool:
    return _console_script
