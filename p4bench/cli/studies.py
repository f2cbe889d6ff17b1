"""`p4bench sweep | tune | compare | reproduce`: many runs, one experiment, one table."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from p4bench.cli.study_output import _num, _print_sweep_summary, err, out
from p4bench.config import parse_key_values
from p4bench.errors import UsageError

if TYPE_CHECKING:
    from p4bench.studies.backends import RunRecord
    from p4bench.studies.compare import Comparison
    from p4bench.studies.sweep_plan import PlannedRun, SweepSpec

_JOBS = typer.Option(1, "--jobs", "-j", help="worker processes for the local backend")
_BACKEND = typer.Option("local", "--backend", help="where runs execute: local | ray")
_ADDRESS = typer.Option(
    None, "--address", help="Ray cluster address (default: start a local Ray instance)"
)
_RESULTS = typer.Option(
    None, "--results-dir", help="folder for local copies and the default MLflow store"
)
_URI = typer.Option(
    None, "--tracking-uri", help="MLflow tracking URI (default: SQLite in the results dir)"
)
_SET = typer.Option([], "--set", help="base run option KEY=VALUE for every run (repeatable)")
_DEVICE = typer.Option(
    None,
    "--device",
    help="where every run's tensors live: cpu | cuda | cuda:N | auto (as --set device=...)",
)
_TUNE_ON_HELP = (
    "federation of the tuning runs: evaluation-clients (the evaluation clients alone: no reported client's "
    "record takes part) or federation (every client; reported clients' training records take part: the "
    "tuned values are not covered by the privacy accounting)"
)
_BUDGET_HELP = (
    "most tuning runs per method and partition, lr's grid included; after lr the paper's other options "
    "are tuned one at a time while it lasts (default: the preset's; lr alone with --quick)"
)
_TUNE_SCOPE_HELP = (
    "which runs one lr tuning serves: partition (lr tuned apart for every partition, level x seed, on "
    "its own evaluation clients: no reported client's record enters the tuning of its run's lr; tuning "
    "runs x partitions) or preset (once per method at the preset's tuning setting and first seed, used "
    "everywhere: cheaper, but other partitions' reported clients may hold the tuning records)"
)
_MIXED = typer.Option(
    False,
    "--allow-mixed-privacy",
    help="compare private runs under different neighbouring relations or with uncertified epsilons "
    "(refused otherwise, exit 2); the table marks each run's privacy",
)


class RunsProgress:
    """A rich progress bar over the runs of a sweep (to stderr)."""

    def __init__(self, title: str, keys: tuple[str, ...] = ()) -> None:
        self.title, self.keys, self.failed = title, keys, 0
        self.bar: Progress | None = None

    def start(self, total: int, skipped: int) -> None:
        if skipped:
            err.print(
                f"{skipped} of {total} runs already finished or not runnable; they are not run again"
            )
        if skipped == total:
            return
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[last]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=err,
        )
        self.bar.start()
        self.task = self.bar.add_task(self.title, total=total - skipped, last="")

    def advance(self, record: RunRecord, planned: PlannedRun) -> None:
        from p4bench.studies.sweep import describe_run

        self.failed += record.status == "failed"
        acc = record.summary.get("accuracy_mean") if record.summary else None
        state = (
            "[red]failed[/red]"
            if record.status == "failed"
            else (
                f"acc {acc:.3f}"
                if isinstance(acc, float) and not math.isnan(acc)
                else record.status
            )
        )
        assert self.bar is not None  # runs advance only after `start` drew the bar
        done = (
            0 if record.status == "interrupted" else 1
        )  # an interrupted run is not done: "0/6 interrupted"
        self.bar.update(
            self.task,
            advance=done,
            last=f"{describe_run(planned, self.keys)}: {state}"
            + (f" ([red]{self.failed} failed[/red])" if self.failed else ""),
        )

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _check_study_paths(
    results_dir: str | None, tracking_uri: str | None, base: Mapping[str, Any] | None = None
) -> None:
    """Before any run: the results folder and the tracking store's folder (as the study will
    derive them from the options, else the base's keys) can be written; a named server answers."""
    from p4bench.run.preflight import check_study_paths

    base = base or {}
    check_study_paths(
        results_dir or base.get("results_dir") or base.get("results-dir"),
        tracking_uri or base.get("tracking_uri") or base.get("tracking-uri"),
    )


def _sets(pairs: list[str], device: str | None = None) -> dict[str, Any]:
    """The `--set` pairs (and `--device`, checked against this machine before any run)."""
    from p4bench.studies.sweep import option_key

    values = parse_key_values(pairs, "--set")
    for key in values:
        option_key(key)
    if device is not None:
        values["device"] = device
    if "device" in values:
        from p4bench.engine.devices import resolve_device

        resolve_device(str(values["device"]))
    return values


def sweep_command(
    file: Path = typer.Argument(
        ..., help="sweep YAML: name, base, axes (and optional variants, include)"
    ),
    jobs: int = _JOBS,
    backend: str = _BACKEND,
    address: str | None = _ADDRESS,
    results_dir: str | None = _RESULTS,
    tracking_uri: str | None = _URI,
    set_: list[str] = _SET,
    device: str | None = _DEVICE,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="list the runs and what would be skipped; run nothing"
    ),
    as_json: bool = typer.Option(
        False, "--json", help="print one JSON line per run after the summary"
    ),
    allow_mixed_privacy: bool = _MIXED,
) -> None:
    """Run every combination of a sweep file into one MLflow experiment; finished runs are skipped.
    Private runs share one neighbouring relation (the sweep's, else add-remove)."""
    from p4bench.studies.backends import make_backend
    from p4bench.studies.sweep import describe_run, load_sweep, run_sweep

    spec = load_sweep(file)
    spec = spec.with_base(**_sets(set_, device))
    if dry_run:
        _dry_run(spec, results_dir, tracking_uri, allow_mixed_privacy)
        return
    _check_study_paths(results_dir, tracking_uri, spec.base)
    keys = tuple(k for k in spec.axes if k not in ("method", "attack", "defense", "seed"))
    report = run_sweep(
        spec,
        make_backend(backend, jobs, address),
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        progress=RunsProgress(f"sweep {spec.name}", keys),
        allow_mixed_privacy=allow_mixed_privacy,
    )
    _print_sweep_summary(report)
    if as_json:
        for planned, record in zip(report.planned, report.records):
            typer.echo(
                json.dumps(
                    {
                        "config_hash": planned.config_hash,
                        "status": record.status,
                        "run": describe_run(planned),
                        "accuracy_mean": record.summary.get("accuracy_mean"),
                        "error": record.error,
                    },
                    default=str,
                )
            )
    if report.failures:
        raise typer.Exit(1)


def _dry_run(
    spec: SweepSpec,
    results_dir: str | None,
    tracking_uri: str | None,
    allow_mixed_privacy: bool = False,
) -> None:
    """List the planned runs, marking those a sweep would skip; creates no store."""
    from p4bench.config import RunConfig
    from p4bench.host.manager import default_registry
    from p4bench.options import validate_planned
    from p4bench.studies.results import finished_runs, tracking_uri_for
    from p4bench.studies.sweep import describe_run, expand
    from p4bench.studies.sweep_privacy import study_privacy

    folder = results_dir or spec.base.get("results_dir") or RunConfig.results_dir
    uri = tracking_uri_for(tracking_uri or spec.base.get("tracking_uri"), folder)
    exists = not uri.startswith("sqlite:///") or Path(uri[len("sqlite:///") :]).exists()
    done = finished_runs(uri, spec.name) if exists else {}
    planned = expand(spec)
    validate_planned(planned, default_registry(), describe_run)  # a dry run reports bad options too
    for notice in study_privacy(spec, planned, allow_mixed=allow_mixed_privacy):
        err.print(f"[yellow]notice:[/yellow] {notice}", highlight=False)
    for run in planned:
        mark = "finished" if (run.config_hash, False) in done else "to run"
        out.print(f"{run.config_hash}  {mark:8}  {describe_run(run)}", highlight=False)
    skipped = sum((run.config_hash, False) in done for run in planned)
    out.print(
        f"{len(planned)} runs, {skipped} already finished in experiment '{spec.name}' at {uri}"
    )


def tune_command(
    file: Path | None = typer.Argument(
        None, help="tuning YAML (name, base, seeds, grid, methods); or use the options"
    ),
    method: list[str] = typer.Option([], "--method", "-m", help="method to tune (repeatable)"),
    grid: list[str] = typer.Option(
        [], "--grid", "-g", help="grid KEY=V1,V2,... for every method (repeatable)"
    ),
    seeds: str | None = typer.Option(
        None, "--seeds", help="tuning seeds, comma separated (default 0)"
    ),
    name: str | None = typer.Option(None, "--name", help="MLflow experiment of the tuning runs"),
    output: Path = typer.Option(
        Path("tuned.yaml"), "--output", "-O", help="where the tuned config goes"
    ),
    jobs: int = _JOBS,
    backend: str = _BACKEND,
    address: str | None = _ADDRESS,
    results_dir: str | None = _RESULTS,
    tracking_uri: str | None = _URI,
    set_: list[str] = _SET,
    device: str | None = _DEVICE,
    allow_mixed_privacy: bool = _MIXED,
    tune_on: str | None = typer.Option(
        None, "--tune-on", help=_TUNE_ON_HELP + " (default: the file's, else evaluation-clients)"
    ),
) -> None:
    """Grid-search each method's hyperparameters on the evaluation clients only; write the best.
    Candidates share one neighbouring relation and must be certified (else exit 2)."""
    from p4bench.run.preflight import check_output_file
    from p4bench.studies.backends import make_backend
    from p4bench.studies.tune import TuneSpec, load_tune, parse_tune, run_tuning, write_tuned
    from p4bench.studies.tune_axes import parse_grid_options
    from p4bench.studies.tune_federation import check_tune_on

    extra = parse_grid_options(grid)
    if file is None:
        spec = parse_tune(
            {"methods": method or None, "grid": {k: list(v) for k, v in extra.items()}},
            source="command line",
        )
    else:
        spec = load_tune(file)
        if method or grid:  # the command line narrows the methods and adds or replaces grid axes
            grids = {
                m: {**spec.grids.get(m, spec.shared), **extra} for m in (method or list(spec.grids))
            }
            for m, g in grids.items():
                if not g:
                    raise UsageError(
                        f"method '{m}' has no grid in {file}; give one with --grid KEY=V1,V2,..."
                    )
            spec = TuneSpec(spec.name, spec.base, grids, spec.seeds, spec.shared)
    base = {**spec.base, **_sets(set_, device)}
    try:
        chosen_seeds = tuple(int(s) for s in seeds.split(",")) if seeds else spec.seeds
    except ValueError:
        raise UsageError(f"--seeds expects integers separated by commas, got {seeds!r}") from None
    experiment = name or (
        spec.name if file is not None else f"tune-{base.get('dataset', 'digits')}"
    )
    spec = TuneSpec(
        experiment,
        base,
        spec.grids,
        chosen_seeds,
        spec.shared,
        check_tune_on(tune_on) if tune_on is not None else spec.tune_on,
    )
    check_output_file(output, "tuned config")
    _check_study_paths(results_dir, tracking_uri, spec.base)
    result = run_tuning(
        spec,
        make_backend(backend, jobs, address),
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        progress=RunsProgress(f"tune {spec.name}"),
        allow_mixed_privacy=allow_mixed_privacy,
    )
    _print_sweep_summary(result.report, err)
    from p4bench.cli.tuning_view import print_tuning

    print_tuning(result, f"over {len(spec.seeds)} seeds")
    path = write_tuned(result, output)
    out.print(
        f"tuned config written to {path} (include it in a sweep file with `include: {path.name}`)"
    )
    if result.report.failures:
        raise typer.Exit(1)


_EVAL_WORDS = {
    "global": "accuracy on the global test set (held out before partitioning)",
    "personal": "accuracy on each client's own test split",
}


def _print_comparison(comparison: Comparison, fmt: str, privacy_note: bool = True) -> None:
    from p4bench.studies.compare import format_table, interval_cell, split_note

    verdict = comparison.privacy if privacy_note else None
    if verdict is not None and verdict.warning:
        err.print(f"[yellow]warning:[/yellow] {verdict.warning}", highlight=False)
    if verdict is not None and any(r.private for r in verdict.runs):
        err.print(verdict.note(), highlight=False)
    split = split_note(comparison.split_by)
    if split is not None:  # a privacy setting the group keys did not separate: one row per setting
        err.print(f"[yellow]notice:[/yellow] {escape(split)}", highlight=False)
    if fmt != "table":
        out.print(format_table(comparison, fmt), markup=False, highlight=False)
        return
    table = Table(title=f"{comparison.experiment}: {comparison.metric} over seeds")
    for key in comparison.group_by:
        table.add_column(key)
    for column in ("mean", "95% (t)", "std", "n"):  # the interval: none where n = 1
        table.add_column(column, justify="right")
    for row in comparison.table.itertuples(index=False):
        *keys, mean, std, n = row
        table.add_row(*map(str, keys), _num(mean), interval_cell(std, n), _num(std), str(n))
    out.print(table)


def compare_command(
    experiment: str = typer.Option(
        ..., "--experiment", "-e", help="MLflow experiment (a sweep's name)"
    ),
    group_by: str | None = typer.Option(
        None,
        "--group-by",
        help="comma-separated keys (default: what varies); a privacy "
        "setting (epsilon, delta, accountant) that varies within a group is added as "
        "a key: a row never pools two",
    ),
    metric: str = typer.Option(
        "final_accuracy_mean",
        "--metric",
        help="MLflow metric to aggregate (runs with --eval "
        "global|both also have final_accuracy_global_mean: the global test set)",
    ),
    fmt: str = typer.Option("table", "--format", help="table | markdown | csv"),
    plot: Path | None = typer.Option(
        None, "--plot", help="save accuracy-per-round curves and a bar chart here"
    ),
    results_dir: str | None = _RESULTS,
    tracking_uri: str | None = _URI,
    allow_mixed_privacy: bool = _MIXED,
) -> None:
    """Aggregate an experiment's runs over seeds (mean, 95% t interval, std, n) per group, print and
    plot. Private runs must share one neighbouring relation and be certified (else exit 2); a row
    never pools two epsilons (deltas, accountants, attacks, defenses): they split rows where a group has several."""
    from p4bench.config import RunConfig
    from p4bench.run.preflight import check_plot_path
    from p4bench.studies.compare import compare_experiment
    from p4bench.studies.compare_plot import plot_comparison
    from p4bench.studies.results import tracking_uri_for

    if fmt not in ("table", "markdown", "csv"):
        raise UsageError(f"unknown format '{fmt}'; choose table, markdown or csv")
    if plot is not None:
        check_plot_path(plot)  # before the store is read
    uri = tracking_uri_for(tracking_uri, results_dir or RunConfig.results_dir)
    keys = [k.strip() for k in group_by.split(",") if k.strip()] if group_by else None
    mixed = allow_mixed_privacy
    comparison = compare_experiment(uri, experiment, keys, metric, allow_mixed_privacy=mixed)
    _print_comparison(comparison, fmt)
    if plot is not None:
        err.print(f"plot written to {plot_comparison(comparison, plot)}")


def reproduce_command(
    name: str = typer.Argument(
        ...,
        help="preset: heterogeneity | privacy | ablation | defense | malicious | karras | p4l | pdsl",
    ),
    dataset: str | None = typer.Option(
        None, "--dataset", help="dataset (default: the paper's; digits if missing)"
    ),
    quick: bool = typer.Option(
        False, "--quick", help="3 rounds, one seed, shorter lists: a smoke run"
    ),
    strict: bool = typer.Option(
        False, "--strict", help="fail on plugins that are not registered instead of skipping"
    ),
    fmt: str = typer.Option("table", "--format", help="table | markdown | csv"),
    plot: Path | None = typer.Option(None, "--plot", help="save curves and a bar chart here"),
    jobs: int = _JOBS,
    backend: str = _BACKEND,
    address: str | None = _ADDRESS,
    results_dir: str | None = _RESULTS,
    tracking_uri: str | None = _URI,
    set_: list[str] = _SET,
    device: str | None = _DEVICE,
    only: list[str] = typer.Option(
        [], "--only", help="keep runs whose option is one of KEY=V1,V2,... (repeatable)"
    ),
    no_tune: bool = typer.Option(
        False, "--no-tune", help="do not tune on the evaluation clients first"
    ),
    tune_rounds: int | None = typer.Option(
        None, "--tune-rounds", help="rounds of the tuning runs (default: the preset's)"
    ),
    tune_on: str = typer.Option("evaluation-clients", "--tune-on", help=_TUNE_ON_HELP),
    tune_scope: str = typer.Option("partition", "--tune-scope", help=_TUNE_SCOPE_HELP),
    tune_budget: int | None = typer.Option(None, "--tune-budget", min=1, help=_BUDGET_HELP),
    allow_mixed_privacy: bool = _MIXED,
) -> None:
    """Rebuild one of the paper's experiments and state whether each of its claims holds.
    lr, then the paper's other options (--tune-budget), are tuned on evaluation clients alone; private
    runs share one relation and target epsilon, and must be certified (else exit 2)."""
    from p4bench.cli.tuning_view import print_reproduce_tuning
    from p4bench.run.preflight import check_plot_path
    from p4bench.studies.backends import make_backend
    from p4bench.studies.compare_plot import plot_comparison
    from p4bench.studies.intervals import seeds_note
    from p4bench.studies.reproduce import claim_note, reproduce, smoke_note
    from p4bench.studies.tune_axes import parse_grid_options

    if fmt not in ("table", "markdown", "csv"):
        raise UsageError(f"unknown format '{fmt}'; choose table, markdown or csv")
    if plot is not None:
        check_plot_path(plot)
    overrides = _sets(set_, device)
    _check_study_paths(
        results_dir, tracking_uri
    )  # reproduce places every run there, whatever the preset's base

    def notice(text: str) -> None:
        err.print(f"[yellow]notice:[/yellow] {text}")

    run_backend = make_backend(backend, jobs, address)
    report = reproduce(
        name,
        dataset,
        quick,
        backend=run_backend,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        strict=strict,
        progress=RunsProgress(f"reproduce {name}"),
        overrides=overrides,
        only=parse_grid_options(only),
        on_notice=notice,
        tune=not no_tune,
        tune_rounds=tune_rounds,
        tune_progress=RunsProgress(f"tune {name}"),
        allow_mixed_privacy=allow_mixed_privacy,
        tune_on=tune_on,
        tune_scope=tune_scope,
        tune_budget=tune_budget,
    )
    print_reproduce_tuning(report)
    _print_sweep_summary(report.sweep, err)
    if report.comparison is not None:
        out.print(
            f"the paper's metric: {_EVAL_WORDS[report.preset.eval_set]} ({report.preset.metric})",
            highlight=False,
        )
        _print_comparison(
            report.comparison, fmt, privacy_note=False
        )  # report.privacy says it below
        if plot is not None:
            err.print(f"plot written to {plot_comparison(report.comparison, plot)}")
    if report.beside is not None:
        other = "personal" if report.preset.eval_set == "global" else "global"
        out.print(
            f"beside it, {_EVAL_WORDS[other]} ({report.preset.beside_metric}):", highlight=False
        )
        _print_comparison(report.beside, fmt, privacy_note=False)
    elif report.comparison is not None and report.preset.eval_set == "personal":
        out.print(
            "no global figure beside it: a global test set would be held out of the clients' data, which this "
            "paper's setup does not do (single runs measure it with --eval both)",
            highlight=False,
        )
    for line in report.extras:  # the preset's own lines: reference values, plots written
        out.print(line, highlight=False, markup=False)
    for line in report.privacy:
        out.print(line, highlight=False, markup=False)
    scale = "quick smoke run" if report.quick else "full run"
    out.print(f"\n[bold]claims of the paper on {report.dataset} ({scale}):[/bold]")
    for note in filter(None, (smoke_note(report), seeds_note(report))):  # how verdicts are reached
        out.print(f"[bold yellow]{escape(note)}[/bold yellow]", highlight=False)
    colours = {"yes": "green", "no": "red", "not checked": "yellow", "not tested": "yellow"}
    for check in report.claims:
        detail = f" ({escape(check.detail)})" if check.detail else ""
        colour = colours.get(check.status, "yellow")
        extra = claim_note(check, report.quick)
        out.print(
            f"- {escape(check.claim)}: [{colour}]{escape(check.status)}[/{colour}]{detail}"
            + (f" [yellow]{escape(extra)}[/yellow]" if extra else ""),
            highlight=False,
        )
    if report.sweep.failures:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_command)
    app.command("tune")(tune_command)
    app.command("compare")(compare_command)
    app.command("reproduce")(reproduce_command)
