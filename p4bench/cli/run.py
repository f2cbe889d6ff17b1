"""`p4bench run`: one run with a progress bar, a summary table and an optional JSON line."""

from __future__ import annotations

import json
import math
import shlex
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from p4bench.cli.entry import console_script
from p4bench.cli.run_options import RunOptions, command_signature, show_config_defaults
from p4bench.cli.summary_table import print_summary
from p4bench.config import RunConfig, resolve_config
from p4bench.errors import UsageError
from p4bench.hookspecs import hookimpl
from p4bench.moved import forward_moved
from p4bench.run.interrupts import RunInterrupted, graceful_interrupts

if TYPE_CHECKING:
    from p4bench.records import RoundReport, RunInfo, RunResult, RunSummary

# the summary table's helpers were defined here before 0.2
__getattr__ = forward_moved(
    __name__, dict.fromkeys(("_rounds_text", "rejections_line"), "p4bench.cli.summary_table")
)


class ProgressDisplay:
    """Observer plugin: a rich progress bar over the rounds of a run (those of the method's
    last phase, as configured; a phase before them, such as P4's grouping, is named while
    it runs). `completed`: rounds a resumed run already has."""

    shows_progress = True  # also shown the privacy check's replay of the run (`p4bench.run.verify`)

    def __init__(self, console: Console, completed: int = 0) -> None:
        self.console = console
        self.completed = completed
        self.progress: Progress | None = None
        self.run_id: str | None = None

    @hookimpl
    def run_started(self, run: RunInfo) -> None:
        from p4bench.privacy.replay import replaying

        self.stop()  # the run's own bar, when this is the privacy check's replay of it
        if replaying():
            self.completed = 0
        self.run_id = run.run_id
        last = run.phases[-1] if run.phases else None
        self.main = last.name if last is not None else ""
        first = (
            run.phases[0].name
            if run.phases and not self.completed and run.phases[0].name != self.main
            else None
        )
        self.method = run.config.method
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        description = f"{self.method} {first}" if first else f"{self.method} rounds"
        if replaying():
            description = f"verifying: replay of {description}"
        total = last.rounds if last is not None else 0
        self.task = self.progress.add_task(
            description, total=total, completed=self.completed, acc="-"
        )

    @hookimpl
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        mean = report.metrics.get("accuracy_mean", float("nan"))
        assert self.progress is not None  # created by run_started
        main = report.phase == self.main
        from p4bench.privacy.replay import replaying

        label = "verifying: replay of " if replaying() else ""
        shown = (
            "-" if replaying() else f"{mean:.3f}"
        )  # the replay trains on other records: its accuracy is no result
        self.progress.update(
            self.task,
            advance=1 if main else 0,
            acc=shown,
            description=label
            + (f"{self.method} rounds" if main else f"{self.method} {report.phase}"),
        )

    @hookimpl
    def run_finished(self, run: RunInfo, result: RunResult) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop drawing (the run ended, or was interrupted)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def say(self, line: str) -> None:
        """One line above the bar (or on the console when there is none)."""
        (self.progress.console if self.progress is not None else self.console).print(
            line, highlight=False, soft_wrap=True
        )


def run_command(**given: Any) -> None:
    """Run one method on one dataset and log it to MLflow.

    A plugin's own options (-o KEY=VALUE) and their defaults: `p4bench describe NAME`.

    Ctrl-C finishes the current round, writes a checkpoint, marks the MLflow run KILLED
    and prints the `--resume` command (exit 130); a second Ctrl-C quits at once."""
    options = RunOptions(**given)  # the parameters are its fields (`command_signature`)
    display = ProgressDisplay(Console(stderr=True))
    with graceful_interrupts(notice=lambda line: display.say(f"[yellow]{escape(line)}[/yellow]")):
        try:
            _run(options, display)
        except RunInterrupted as stopped:
            display.stop()
            display.say(f"[yellow]{escape(stopped.line())}[/yellow]")
            raise typer.Exit(130) from None
        except KeyboardInterrupt:
            display.stop()
            display.say(
                f"[yellow]{escape(_stopped_at_once(display, options.results_dir))}[/yellow]"
            )
            raise typer.Exit(130) from None


def _stopped_at_once(display: ProgressDisplay, results_dir: str | None) -> str:
    """The line for a run stopped at once (a second Ctrl-C, or one during start-up)."""
    if display.run_id is None:
        return "interrupted during start-up; nothing was trained"
    from p4bench.run.checkpoint import find_run_folder, load

    folder = find_run_folder(display.run_id, results_dir or RunConfig.results_dir)
    if folder is not None and load(folder) is not None:
        return (
            f"stopped at once; the last checkpoint is in {folder}; "
            f"resume with: p4bench run --resume {shlex.quote(str(folder))}"
        )
    return "stopped at once, before a checkpoint was written; nothing to resume"


def _run(options: RunOptions, display: ProgressDisplay) -> None:
    """`run_command`'s work, on its options."""
    from p4bench.tracking import worker as tracking_worker

    resolved = None
    if options.resume is None:  # a bad value or name: one line before torch or MLflow is imported
        options = options.with_local_peers()
        resolved = resolve_config(options.config, options.overrides())
        check_plugin_names(resolved)
    tracking_worker.prestart(
        enabled=console_script()
    )  # MLflow's import on the other core, beside torch's
    try:
        if resolved is None:
            _resume(options, display)
        else:
            _run_new(options, resolved, display)
    finally:
        tracking_worker.discard_prestarted()  # no tracker took it: the run failed before it started


def check_plugin_names(config: RunConfig) -> None:
    """Refuse a plugin name that no installed plugin registers, from the cached plugin
    listing (`p4bench.cli.plugin_cache`: entry points and their files, no import of a
    plugin while it is current), so that a mistyped name costs no torch import. Where an
    installed plugin has a problem, the registry's own message names it, later."""
    from p4bench.cli.plugin_cache import cached_listing
    from p4bench.errors import UnknownNameError

    listing, _ = cached_listing()
    if listing.get("problems"):  # a broken or ambiguous plugin: the registry names its problem
        return
    given = {
        "method": config.method,
        "dataset": config.dataset,
        "partitioner": config.partitioner,
        "model": config.model,
        "runtime": config.runtime,
        "accountant": config.accountant,
        "attack": config.attack,
        "defense": config.defense if config.defense != "none" else None,
    }
    for kind, name in given.items():
        names = {str(entry.get("name")) for entry in listing.get(kind, [])}
        if name is not None and names and name not in names:
            raise UnknownNameError(kind, name, names)


def _run_new(options: RunOptions, resolved: RunConfig, display: ProgressDisplay) -> None:
    from p4bench.host.manager import default_plugin_manager
    from p4bench.run.runner import run
    from p4bench.tracking.links import check_run_server

    check_run_server(resolved)  # a named MLflow server that does not answer: exit 2, nothing run
    if options.topology is not None or options.topology_option:
        check_topology_flags(resolved.method)
    pm = default_plugin_manager()
    result = run(resolved, observers=[display], plugin_manager=pm)
    _report(result.summary, options.as_json)


def check_topology_flags(method: str) -> None:
    """A method that sends over no graph of the topology harness has no use for
    `--topology`: one line naming the methods that do."""
    from p4bench.host.legacy import takes_undeclared
    from p4bench.host.manager import default_registry

    registry = default_registry()
    users = [
        e.name
        for e in registry.entries("method")
        if any(getattr(o, "name", None) == "topology" for o in getattr(e.cls, "options", ()))
    ]
    if method not in users and not takes_undeclared(registry.entry("method", method)):  # 0.1
        raise UsageError(
            f"method '{method}' communicates over no topology of the harness, so --topology does not "
            f"apply; methods that do: {', '.join(users)}"
        )


def _report(summary: RunSummary, as_json: bool) -> None:
    print_summary(Console(stderr=as_json), summary)
    if as_json:
        typer.echo(json.dumps(summary.as_dict(), default=json_default))


def _resume(o: RunOptions, display: ProgressDisplay) -> None:
    """`--resume`: continue an interrupted run from its checkpoint, in its folder and MLflow run."""
    from p4bench.host.manager import default_plugin_manager
    from p4bench.run.checkpoint import FORMAT, find_run_folder, load
    from p4bench.run.runner import run
    from p4bench.studies.results import tracking_uri_for

    kept = ("results_dir", "tracking_uri", "device", "threads")  # where and how, not what
    given = sorted(k for k in o.overrides() if k not in kept)
    if given or o.config is not None or o.local_peers is not None:
        named = ", ".join(f"--{k.replace('_', '-')}" for k in given) or "--config / --local-peers"
        raise UsageError(
            f"--resume continues a run with its saved options; it takes no run options ({named} given)"
        )
    reference = str(o.resume)
    results_dir = o.results_dir or RunConfig.results_dir
    folder = find_run_folder(reference, results_dir, tracking_uri_for(o.tracking_uri, results_dir))
    if folder is None:
        raise UsageError(
            f"no run '{reference}' to resume: not a folder, not a run in {results_dir}, not an MLflow run "
            "there (give the run's results folder, or --results-dir / --tracking-uri)"
        )
    checkpoint = load(folder)
    if checkpoint is None:
        if (folder / "summary.json").is_file():
            display.say(
                f"run in {escape(str(folder))} already finished; nothing to resume (its results are there)"
            )
            return
        raise UsageError(
            f"{folder} holds no checkpoint: the run stopped before its first round finished, or it is not "
            "a p4bench run folder; start the run again"
        )
    if checkpoint.meta.get("format") != FORMAT:
        raise UsageError(
            f"the checkpoint in {folder} was written by another p4bench version (format "
            f"{checkpoint.meta.get('format')}); start the run again"
        )
    try:
        checkpoint.state()
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one line, not a traceback
        raise UsageError(
            f"the checkpoint in {folder} cannot be read ({type(exc).__name__}); start the run again"
        ) from None
    # may move devices; takes the cores it may use now (or --threads), not those it had
    config = RunConfig(
        **{**checkpoint.config, "threads": o.threads, **({"device": o.device} if o.device else {})}
    )
    if checkpoint.meta.get("secret_randomness"):
        display.say(
            "[yellow]this run draws secret (OS-CSPRNG) randomness, which cannot be replayed: the resumed rounds "
            "draw fresh noise, so results are not bit-identical to an uninterrupted run[/yellow]"
        )
    display.completed = int(checkpoint.meta.get("rounds_completed", 0))
    result = run(
        config, observers=[display], plugin_manager=default_plugin_manager(), resume=checkpoint
    )
    _report(result.summary, o.as_json)


def json_default(value: Any) -> Any:
    """`json.dumps` fallback for summaries: NaN as null, anything else as its string."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


setattr(run_command, "__signature__", command_signature())  # noqa: B010 - typer reads it


def register(app: typer.Typer) -> None:
    show_config_defaults()
    app.command("run")(run_command)
