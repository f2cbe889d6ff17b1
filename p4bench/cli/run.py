"""`p4bench run`: one run with a progress bar, a summary table and an optional JSON line."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
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

from p4bench.cli.completion import completer
from p4bench.cli.entry import console_script
from p4bench.cli.summary_table import print_summary
from p4bench.config import RunConfig, parse_key_values, resolve_config
from p4bench.errors import UsageError
from p4bench.hookspecs import hookimpl
from p4bench.moved import forward_moved
from p4bench.run.interrupts import RunInterrupted, graceful_interrupts

if TYPE_CHECKING:
    from p4bench.records import RoundReport, RunInfo, RunResult

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


def run_command(
    method: str | None = typer.Option(
        None, help="method name (see `p4bench list`)", autocompletion=completer("method")
    ),
    attack: str | None = typer.Option(
        None, help="attack name, or none", autocompletion=completer("attack")
    ),
    defense: str | None = typer.Option(
        None, help="defense name, or none", autocompletion=completer("defense")
    ),
    dataset: str | None = typer.Option(
        None, help="dataset name (default digits, offline)", autocompletion=completer("dataset")
    ),
    partitioner: str | None = typer.Option(
        None, help="iid | alpha | ... (see `p4bench list`)", autocompletion=completer("partitioner")
    ),
    similarity: float | None = typer.Option(
        None, help="alpha partitioner: fraction of IID samples, 0..1"
    ),
    clients: int | None = typer.Option(None, help="number of clients M"),
    samples_per_client: int | None = typer.Option(None, help="samples per client R (train + test)"),
    rounds: int | None = typer.Option(None, help="communication rounds T"),
    local_steps: int | None = typer.Option(None, help="local steps K per round"),
    client_rate: float | None = typer.Option(None, help="client sampling ratio l in (0, 1]"),
    data_rate: float | None = typer.Option(None, help="data sampling ratio s in (0, 1]"),
    lr: float | None = typer.Option(None, help="local step size"),
    global_lr: float | None = typer.Option(None, help="global step size eta_g"),
    malicious_fraction: float | None = typer.Option(
        None, help="fraction of malicious clients under --attack"
    ),
    epsilon: float | None = typer.Option(
        None, help="target epsilon per client (DP methods default to 8; makes any method private)"
    ),
    no_dp: bool = typer.Option(
        False,
        "--no-dp",
        help="train a DP method without DP (no epsilon; the summary says non-private)",
    ),
    delta: float | None = typer.Option(None, help="target delta (default 1 / training records)"),
    noise_multiplier: float | None = typer.Option(
        None, help="DP noise multiplier (default: calibrated from --epsilon)"
    ),
    clip: float | None = typer.Option(None, help="DP per-example clipping norm C"),
    neighbouring: str | None = typer.Option(
        None, help="add-remove | replace-one (default: the method's)"
    ),
    accountant: str | None = typer.Option(
        None, help="privacy accountant: pld (default) | rdp | prv | noble"
    ),
    noise_source: str | None = typer.Option(
        None,
        help="DP noise and batches: auto (default: secure on devices, seeded in simulation) "
        "| seeded (reproducible, not secret) "
        "| secure (secret per client, keyed from the OS CSPRNG)",
    ),
    noise_generator: str | None = typer.Option(
        None,
        help="seeded DP noise: auto (default: torch on cpu, philox on GPUs) | torch "
        "| philox (same numbers on CPU and GPU)",
    ),
    device_simulation: bool = typer.Option(
        False,
        "--device-simulation",
        help="device runtime: allow seeded DP randomness (a simulation on devices; epsilon uncertified)",
    ),
    feature_norm: str | None = typer.Option(
        None,
        help="scatter features: sample (default, per-sample group norm) | client (the paper's, uncertified) | none",
    ),
    eval_fraction: float | None = typer.Option(
        None, help="fraction of clients reserved for tuning"
    ),
    eval_set: str | None = typer.Option(
        None,
        "--eval",
        help="where accuracy is measured: personal (default: each client's own test split) | global "
        "(one test set held out before partitioning; the headline) | both (personal the headline, global beside)",
    ),
    hold_out_public: bool = typer.Option(
        False,
        "--hold-out-public",
        help="hold out the public pool of a method that reads public data (FedDF) even "
        "when this one reads none: the clients then hold exactly the records they hold in such a run",
    ),
    features: str | None = typer.Option(
        None, help="raw | scatter (ScatterNet J=2, L=8; see --feature-norm)"
    ),
    shards_per_client: int | None = typer.Option(
        None, help="shards partitioner: classes per client N"
    ),
    model: str | None = typer.Option(
        None,
        help="model architecture (linear, scatter-cnn, cnn, ...)",
        autocompletion=completer("model"),
    ),
    runtime: str | None = typer.Option(
        None,
        help="runtime: simulation | reference | bytes | device | ...",
        autocompletion=completer("runtime"),
    ),
    topology: str | None = typer.Option(
        None,
        "--topology",
        help="communication graph of a method that sends over one (a topology plugin: ring, "
        "complete, exponential, ...; `p4bench describe METHOD` says whether and which)",
        autocompletion=completer("topology"),
    ),
    topology_option: list[str] = typer.Option(
        [],
        "--topology-option",
        metavar="KEY=VALUE",
        help="an option of --topology's graph, e.g. k=4 (repeatable)",
    ),
    local_peers: int | None = typer.Option(
        None,
        help="device runtime: N peer processes on 127.0.0.1 (sets --runtime device and --clients N)",
    ),
    seed: int | None = typer.Option(None, help="random seed"),
    device: str | None = typer.Option(
        None,
        help="where tensors live: cpu (default) | cuda | cuda:N | auto (a GPU where there is one); recorded in the run",
    ),
    time_budget: float | None = typer.Option(
        None,
        "--time-budget",
        metavar="MINUTES",
        help="count the rounds that finish within MINUTES of training: the run stops after the first round that ends "
        "past it and reports the round before (all runtimes; on devices the launcher's clock decides and every "
        "peer stops after the same round)",
    ),
    memory_budget: float | None = typer.Option(
        None,
        "--memory-budget",
        metavar="GB",
        help="memory the DP step's per-example gradients may take at once; clients are chunked to fit, results do not "
        "change (default: half the device's free memory)",
    ),
    verify: str | None = typer.Option(
        None,
        "--verify",
        help="privacy verification by behaviour: full (the run itself, recorded and replayed once at "
        "its own size; the only mode that certifies) | stand-in (a 4-client, 2-round federation: printed as such, not "
        "certified) | off (not certified); default: $P4BENCH_VERIFY, else full",
    ),
    config: Path | None = typer.Option(
        None, "--config", help="YAML file of run options (CLI options win)"
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="RUN_ID_OR_DIR",
        help="continue an interrupted run from its last checkpoint: its results folder, local run id or MLflow run id "
        "(with --results-dir / --tracking-uri where not the defaults); no other run options. The run goes on in "
        "the same folder and MLflow run and ends as the uninterrupted run would (seeded randomness). A finished run "
        "is not run again: one line says so, exit 0",
    ),
    experiment: str | None = typer.Option(None, help="MLflow experiment name"),
    tracking_uri: str | None = typer.Option(
        None, help="MLflow tracking URI (default: SQLite in the results dir)"
    ),
    results_dir: str | None = typer.Option(None, help="folder for local copies of results"),
    option: list[str] = typer.Option(
        [], "--option", "-o", help="plugin option KEY=VALUE (repeatable)"
    ),
    as_json: bool = typer.Option(
        False, "--json", help="print the summary as one JSON object on the last line"
    ),
) -> None:
    """Run one method on one dataset and log it to MLflow.

    A plugin's own options (-o KEY=VALUE) and their defaults: `p4bench describe NAME`.

    Ctrl-C finishes the current round, writes a checkpoint, marks the MLflow run KILLED
    and prints the `--resume` command (exit 130); a second Ctrl-C quits at once."""
    display = ProgressDisplay(Console(stderr=True))
    with graceful_interrupts(notice=lambda line: display.say(f"[yellow]{escape(line)}[/yellow]")):
        try:
            _run(locals(), display, as_json)  # the options by name
        except RunInterrupted as stopped:
            display.stop()
            display.say(f"[yellow]{escape(stopped.line())}[/yellow]")
            raise typer.Exit(130) from None
        except KeyboardInterrupt:
            display.stop()
            display.say(f"[yellow]{escape(_stopped_at_once(display, results_dir))}[/yellow]")
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


def _run(options: dict[str, Any], display: ProgressDisplay, as_json: bool) -> None:
    """`run_command`'s work, on its options (the CLI parameters by name)."""
    from p4bench.tracking import worker as tracking_worker

    tracking_worker.prestart(
        enabled=console_script()
    )  # MLflow's import on the other core, beside torch's
    try:
        _run_or_resume(options, display, as_json)
    finally:
        tracking_worker.discard_prestarted()  # no tracker took it: the run failed before it started


def _run_or_resume(options: dict[str, Any], display: ProgressDisplay, as_json: bool) -> None:
    from p4bench.host.manager import default_plugin_manager
    from p4bench.run.runner import run

    o = dict(options)
    if o["resume"] is not None:
        _resume(o, display, as_json)
        return
    local_peers, runtime, clients, option = (
        o["local_peers"],
        o["runtime"],
        o["clients"],
        o["option"],
    )
    if local_peers is not None:  # the device plugin's local mode: one client per peer process
        if runtime not in (None, "device"):
            raise UsageError(
                f"--local-peers runs the device runtime; it cannot be combined with --runtime {runtime}"
            )
        runtime, clients = runtime or "device", clients or local_peers
        option = [*option, f"device_local_peers={local_peers}"]
    o.update(runtime=runtime, clients=clients, option=option)
    resolved = resolve_config(o["config"], _overrides(o))
    if o["topology"] is not None or o["topology_option"]:
        check_topology_flags(resolved.method)
    pm = default_plugin_manager()
    result = run(resolved, observers=[display], plugin_manager=pm)
    _report(result.summary, as_json)


def _overrides(o: dict[str, Any]) -> dict[str, Any]:
    """The run options given on the command line (config fields)."""
    given = o[
        "shards_per_client"
    ]  # 0 too: the partitioner's own check refuses it (not a silent default)
    plugin_options = {
        **({"shards_per_client": given} if given is not None else {}),
        **parse_key_values(o["option"]),
    }
    plugin_options.update(topology_overrides(o["topology"], o["topology_option"], plugin_options))
    # a parameter named like a config field is that field (declared once, in RunConfig);
    # the rest are the flags below, whose names differ from their fields
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {
        name: value
        for name, value in o.items()
        if name in fields
        and name not in ("options", "no_dp", "device_simulation", "hold_out_public")
    }
    values.update(
        no_dp=o["no_dp"] or None,
        device_simulation=o["device_simulation"] or None,
        hold_out_public=o["hold_out_public"] or None,
        time_budget_min=o["time_budget"],
        memory_budget_gb=o["memory_budget"],
        options=plugin_options or None,
    )
    return {k: v for k, v in values.items() if v is not None}


def topology_overrides(
    name: str | None, pairs: list[str], options: dict[str, Any]
) -> dict[str, Any]:
    """`--topology` and `--topology-option` as the method's options `topology` and
    `topology_options` (those of `p4bench.options.topology_options`); refused when `-o`
    sets the same option too."""
    given: dict[str, Any] = {}
    if name is not None:
        given["topology"] = name
    if pairs:
        given["topology_options"] = parse_key_values(pairs, flag="--topology-option")
    for key, flag in (("topology", "--topology"), ("topology_options", "--topology-option")):
        if key in given and key in options:
            raise UsageError(f"{flag} and -o {key}=... both set the topology; give one")
    return given


def check_topology_flags(method: str) -> None:
    """A method that sends over no graph of the topology harness has no use for
    `--topology`: one line naming the methods that do."""
    from p4bench.host.manager import default_registry

    registry = default_registry()
    users = [
        e.name
        for e in registry.entries("method")
        if any(getattr(o, "name", None) == "topology" for o in getattr(e.cls, "options", ()))
    ]
    if method not in users:
        registry.get("method", method)  # an unknown method says so first
        raise UsageError(
            f"method '{method}' communicates over no topology of the harness, so --topology does not "
            f"apply; methods that do: {', '.join(users)}"
        )


def _report(summary: dict[str, Any], as_json: bool) -> None:
    print_summary(Console(stderr=as_json), summary)
    if as_json:
        typer.echo(json.dumps(summary, default=json_default))


def _resume(o: dict[str, Any], display: ProgressDisplay, as_json: bool) -> None:
    """`--resume`: continue an interrupted run from its checkpoint, in its folder and MLflow run."""
    from p4bench.host.manager import default_plugin_manager
    from p4bench.run.checkpoint import FORMAT, find_run_folder, load
    from p4bench.run.runner import run
    from p4bench.studies.results import tracking_uri_for

    given = sorted(k for k in _overrides(o) if k not in ("results_dir", "tracking_uri", "device"))
    if given or o["config"] is not None or o["local_peers"] is not None:
        named = ", ".join(f"--{k.replace('_', '-')}" for k in given) or "--config / --local-peers"
        raise UsageError(
            f"--resume continues a run with its saved options; it takes no run options ({named} given)"
        )
    reference = str(o["resume"])
    results_dir = o["results_dir"] or RunConfig.results_dir
    folder = find_run_folder(
        reference, results_dir, tracking_uri_for(o["tracking_uri"], results_dir)
    )
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
    config = RunConfig(
        **{**checkpoint.config, **({"device": o["device"]} if o["device"] else {})}
    )  # may move devices
    if checkpoint.meta.get("secret_randomness"):
        display.say(
            "[yellow]this run draws secret (OS-CSPRNG) randomness, which cannot be replayed: the resumed rounds "
            "draw fresh noise, so results are not bit-identical to an uninterrupted run[/yellow]"
        )
    display.completed = int(checkpoint.meta.get("rounds_completed", 0))
    result = run(
        config, observers=[display], plugin_manager=default_plugin_manager(), resume=checkpoint
    )
    _report(result.summary, as_json)


def json_default(value: Any) -> Any:
    """`json.dumps` fallback for summaries: NaN as null, anything else as its string."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def show_config_defaults(command: Any, config: RunConfig | None = None) -> None:
    """Show the run's real defaults in `--help`: options default to None (so that a
    `--config` file can set them) and typer would show nothing; take each one's default
    from the `RunConfig` field of the same name, where it has one."""
    import dataclasses
    import inspect

    base = config or RunConfig()
    defaults = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    for name, parameter in inspect.signature(command).parameters.items():
        info = parameter.default
        field = {"time_budget": "time_budget_min", "memory_budget": "memory_budget_gb"}.get(
            name, name
        )
        value = defaults.get(field)
        shown = value is not None and value is not False and not isinstance(value, dict)
        if isinstance(info, typer.models.OptionInfo) and info.default is None and shown:
            info.show_default = str(value)


def register(app: typer.Typer) -> None:
    show_config_defaults(run_command)
    app.command("run")(run_command)
