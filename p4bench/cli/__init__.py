"""The `p4bench` command line: thin adapters over library functions.

`main` is the one exception boundary of the command line:

- every `P4BenchError` becomes one red line on stderr and the error's exit code (2 for
  bad input);
- so do the failures a user causes that are not ours (`p4bench.errors.user_error_line`):
  paths that cannot be created or written (permission, a file where a folder is meant,
  a full or read-only disk), unusable or unreachable MLflow stores, invalid YAML; exit 2;
- anything else is a bug: its traceback, then one line asking to report it; exit 1;
- Ctrl-C that no command handled: one line, "interrupted", exit 130, no traceback (also
  while the script imports this module: `p4bench.console`).

`P4BENCH_TRACEBACK=1` prints the traceback of user errors too (to tell a user error from
a bug that raised an OSError on a path).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import typer
from rich.console import Console

from p4bench.cli.entry import mark_console_script
from p4bench.errors import P4BenchError, one_line
from p4bench.moved import forward_moved

__all__ = ["build_app", "main", "version_line"]
# defined here before 0.2
__getattr__ = forward_moved(__name__, {"warn_plugin_problems": "p4bench.cli.problems"})

TRACEBACK_ENV = "P4BENCH_TRACEBACK"
USER_ERROR_EXIT = 2
BUG_EXIT = 1
INTERRUPT_EXIT = 130
HELP = "Benchmark differentially private, peer-to-peer, personalized learning methods."

err_console = Console(stderr=True)


def build_app() -> typer.Typer:
    """The typer app with built-in commands and those plugins add via `register_commands`."""
    from p4bench.cli import check_plugin, describe, listing, run
    from p4bench.host.manager import add_plugin_commands

    app = typer.Typer(
        name="p4bench",
        help=HELP,
        no_args_is_help=True,
        add_completion=True,  # --install-completion / --show-completion
        pretty_exceptions_enable=False,
    )
    app.callback(help=HELP)(_root)
    _one_line_usage_errors()
    run.register(app)
    listing.register(app)
    describe.register(app)
    check_plugin.register(app)
    add_plugin_commands(_command_source(), app)  # a broken plugin's commands become a warning
    return app


def _command_source() -> Any:
    """The plugin manager whose `register_commands` build the app: the process-wide one,
    unless it is not built yet and the cached plugin listing says no installed plugin adds
    commands; then one of the built-ins alone, so that `--help` imports no installed
    plugin (a plugin module may import torch)."""
    from p4bench.cli.plugin_cache import only_builtin_commands
    from p4bench.host.manager import create_plugin_manager, default_built, default_plugin_manager

    if not default_built() and only_builtin_commands():
        return create_plugin_manager(autoload=False)
    return default_plugin_manager()


def _one_line_usage_errors() -> None:
    """Click's usage errors (a value of the wrong type, a mistyped command or option) as
    one line like every other bad input, not typer's boxed usage text: typer renders them
    with `rich_utils.rich_format_error`, looked up when it shows one. Also: flags' help
    rows show no value type."""
    import typer.core
    import typer.rich_utils

    typer.rich_utils.rich_format_error = _say_usage_error  # type: ignore[assignment]
    # and a flag (`--json`) takes no value: its help row shows none (typer shows "<bool>",
    # and `--json true` is then refused as an extra argument)
    shown = typer.core.TyperOption.display_type_rich
    if not getattr(shown, "_p4bench_flags", False):

        def display_type_rich(self: Any, ctx: Any) -> str | None:
            return None if getattr(self, "is_flag", False) else shown(self, ctx)

        display_type_rich._p4bench_flags = True  # type: ignore[attr-defined]
        typer.core.TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def _say_usage_error(exc: Exception) -> None:
    from rich.markup import escape

    ctx = getattr(exc, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    err_console.print(
        f"[bold red]error:[/bold red] {escape(one_line(message))}{escape(hint)}",
        highlight=False,
        soft_wrap=True,
    )


def version_line() -> str:
    """`p4bench X.Y.Z`: the installed distribution's version (the source's when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("p4bench")
    except PackageNotFoundError:
        from p4bench.version import __version__ as number
    return f"p4bench {number}"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `p4bench` script: the exception boundary (module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if argv is None:  # the console script: the process ends with the command
        mark_console_script()
        atexit.register(
            _skip_exit_collections
        )  # runs after the exit handlers the command registers
    if args == ["--version"]:  # answered before the app and its plugins are built: fast
        print(version_line())
        sys.exit(0)
    try:
        show_plugin_deprecations()
        app = build_app()  # plugin problems are shown by `list` and `describe`, and by a command that needs the plugin
        app(args=args, prog_name="p4bench")
    except SystemExit as exc:
        interrupt = _typer_interrupt(exc) if exc.code == INTERRUPT_EXIT else None
        if interrupt is not None:  # Ctrl-C that no command handled
            _say_interrupted(interrupt)
        raise
    except KeyboardInterrupt as exc:  # while building the app, before typer runs the command
        _say_interrupted(exc)
        sys.exit(INTERRUPT_EXIT)
    except Exception as exc:  # noqa: BLE001 - the boundary: every failure ends here
        _report(exc)


def show_plugin_deprecations() -> None:
    """Show each deprecated plugin API call once per place and command, as one line naming
    the place (Python hides DeprecationWarnings raised in plugin code, and prints two lines;
    its own once-per-place registry forgets what it showed whenever a warnings filter
    changes, e.g. in a run's verification replay)."""
    import warnings

    from rich.markup import escape

    from p4bench.errors import PluginDeprecationWarning

    shown = warnings.showwarning
    if getattr(shown, "p4bench", False):
        shown.seen.clear()  # type: ignore[attr-defined]  # a new command shows them again
        return
    seen: set[tuple[str, str, int]] = set()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if not issubclass(category, PluginDeprecationWarning):
            shown(message, category, filename, lineno, file, line)
            return
        if (str(message), filename, lineno) in seen:
            return
        seen.add((str(message), filename, lineno))
        err_console.print(
            f"[yellow]warning:[/yellow] {escape(str(message))} ({escape(filename)}:{lineno})",
            highlight=False,
            soft_wrap=True,
        )

    show.p4bench = True  # type: ignore[attr-defined]
    show.seen = seen  # type: ignore[attr-defined]
    warnings.showwarning = show
    warnings.filterwarnings("default", category=PluginDeprecationWarning)


def _skip_exit_collections() -> None:
    """Collect garbage once, then freeze what survives, so that the interpreter's own
    collections while it shuts down skip every object: with torch, MLflow and matplotlib
    loaded they take about 0.3 s after `p4bench list` and over 1 s after a run."""
    import gc

    gc.collect()
    gc.freeze()


def _report(exc: Exception) -> None:
    """One line and exit 2 for a user's failure; traceback, a report line and exit 1 for a bug."""
    from rich.markup import escape

    from p4bench.errors import user_error_line

    try:
        line = user_error_line(exc)
    except Exception:  # noqa: BLE001 - describing the error must not hide it
        line = None
    if line is not None:
        if os.environ.get(TRACEBACK_ENV):
            _print_traceback(exc)
        code = exc.exit_code if isinstance(exc, P4BenchError) else USER_ERROR_EXIT
        err_console.print(
            f"[bold red]error:[/bold red] {escape(line)}", highlight=False, soft_wrap=True
        )
        sys.exit(code)
    _print_traceback(exc)
    err_console.print(
        f"[bold red]this is a bug in {escape(version_line())}[/bold red] (or in a plugin named in the "
        "traceback): please report it with the traceback above and the command you ran, "
        f"{escape(_issue_tracker())}",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(BUG_EXIT)


def _issue_tracker() -> str:
    """Where to report: the distribution's issue-tracker URL when its metadata names one."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("p4bench").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if any(word in label.lower() for word in ("issue", "bug", "tracker")):
            return f"at {url.strip()}"
    return "on the project's issue tracker"


def _print_traceback(exc: BaseException) -> None:
    import traceback

    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    sys.stderr.flush()


def _typer_interrupt(exc: SystemExit) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that escaped the command when typer turned it into exit 130
    (`raise Exit(130) from KeyboardInterrupt` in typer.core); None for an exit 130 that a
    command raised itself after handling the interrupt (it printed its own message)."""
    exit_ = exc.__context__
    if exit_ is None or not isinstance(exit_.__cause__, KeyboardInterrupt):
        return None
    tb = exit_.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_globals.get("__name__") != "typer.core":
        return None
    return exit_.__cause__


def _say_interrupted(exc: KeyboardInterrupt) -> None:
    """One line: the interrupt's own message when it has one (a stopped run says where its
    results are and how to resume), else "interrupted"."""
    from rich.markup import escape

    try:
        message = one_line(str(exc)) if type(exc) is not KeyboardInterrupt else ""
        err_console.print(
            f"[yellow]{escape(message or 'interrupted')}[/yellow]", highlight=False, soft_wrap=True
        )
    except KeyboardInterrupt:  # a second Ctrl-C while saying so
        pass
