"""`p4bench run`: one run with a progress bar, a summary table and an optional JSON line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from p4bench.config import parse_key_values, resolve_config
from p4bench.errors import UsageError
from p4bench.hookspecs import hookimpl


class ProgressDisplay:
    """Observer plugin: a rich progress bar over all rounds of a run."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None

    @hookimpl
    def run_started(self, run) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(f"{run.config.method} rounds", total=run.total_rounds, acc="-")

    @hookimpl
    def round_finished(self, run, report) -> None:
        mean = report.metrics.get("accuracy_mean", float("nan"))
        assert self.progress is not None  # created by run_started
        self.progress.update(self.task, advance=1, acc=f"{mean:.3f}")

    @hookimpl
    def run_finished(self, run, result) -> None:
        assert self.progress is not None  # created by run_started
        self.progress.stop()


def run_command(
    method: str | None = typer.Option(None, help="method name (see `p4bench list`)"),
    attack: str | None = typer.Option(None, help="attack name, or none"),
    defense: str | None = typer.Option(None, help="defense name, or none"),
    dataset: str | None = typer.Option(None, help="dataset name (default digits, offline)"),
    partitioner: str | None = typer.Option(None, help="iid | alpha | ... (see `p4bench list`)"),
    similarity: float | None = typer.Option(None, help="alpha partitioner: fraction of IID samples, 0..1"),
    clients: int | None = typer.Option(None, help="number of clients M"),
    samples_per_client: int | None = typer.Option(None, help="samples per client R (train + test)"),
    rounds: int | None = typer.Option(None, help="communication rounds T"),
    local_steps: int | None = typer.Option(None, help="local steps K per round"),
    client_rate: float | None = typer.Option(None, help="client sampling ratio l in (0, 1]"),
    data_rate: float | None = typer.Option(None, help="data sampling ratio s in (0, 1]"),
    lr: float | None = typer.Option(None, help="local step size"),
    global_lr: float | None = typer.Option(None, help="global step size eta_g"),
    malicious_fraction: float | None = typer.Option(None, help="fraction of malicious clients under --attack"),
    epsilon: float | None = typer.Option(None, help="target epsilon per client (DP methods default to 8; makes any method private)"),
    no_dp: bool = typer.Option(False, "--no-dp", help="train a DP method without DP (no epsilon; the summary says non-private)"),
    delta: float | None = typer.Option(None, help="target delta (default 1 / training records)"),
    noise_multiplier: float | None = typer.Option(None, help="DP noise multiplier (default: calibrated from --epsilon)"),
    clip: float | None = typer.Option(None, help="DP per-example clipping norm C"),
    neighbouring: str | None = typer.Option(None, help="add-remove | replace-one (default: the method's)"),
    accountant: str | None = typer.Option(None, help="privacy accountant: pld (default) | rdp | prv | noble"),
    noise_source: str | None = typer.Option(
        None,
        help="DP noise and batches: auto (default: secure on devices, seeded in simulation) | seeded (reproducible, not secret) "
        "| secure (secret per client, keyed from the OS CSPRNG)",
    ),
    device_simulation: bool = typer.Option(
        False, "--device-simulation", help="device runtime: allow seeded DP randomness (a simulation on devices; epsilon uncertified)"
    ),
    feature_norm: str | None = typer.Option(
        None, help="scatter features: sample (default, per-sample group norm) | client (the paper's, uncertified) | none"
    ),
    eval_fraction: float | None = typer.Option(None, help="fraction of clients reserved for tuning"),
    features: str | None = typer.Option(None, help="raw | scatter (ScatterNet J=2, L=8; see --feature-norm)"),
    shards_per_client: int | None = typer.Option(None, help="shards partitioner: classes per client N"),
    model: str | None = typer.Option(None, help="model architecture (linear, scatter-cnn, cnn, ...)"),
    runtime: str | None = typer.Option(None, help="runtime: simulation | reference | bytes | device | ..."),
    local_peers: int | None = typer.Option(
        None, help="device runtime: N peer processes on 127.0.0.1 (sets --runtime device and --clients N)"
    ),
    seed: int | None = typer.Option(None, help="random seed"),
    time_budget: float | None = typer.Option(
        None, "--time-budget", metavar="MINUTES",
        help="stop after the first round that ends past MINUTES of training (all runtimes; on devices the launcher's "
             "clock decides and every peer stops after the same round); reports the rounds completed",
    ),
    config: Path | None = typer.Option(None, "--config", help="YAML file of run options (CLI options win)"),
    experiment: str | None = typer.Option(None, help="MLflow experiment name"),
    tracking_uri: str | None = typer.Option(None, help="MLflow tracking URI (default: SQLite in the results dir)"),
    results_dir: str | None = typer.Option(None, help="folder for local copies of results"),
    option: list[str] = typer.Option([], "--option", "-o", help="plugin option KEY=VALUE (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object on the last line"),
) -> None:
    """Run one method on one dataset and log it to MLflow."""
    from p4bench.plugin_manager import default_plugin_manager
    from p4bench.runner import run

    if local_peers is not None:  # the device plugin's local mode: one client per peer process
        if runtime not in (None, "device"):
            raise UsageError(f"--local-peers runs the device runtime; it cannot be combined with --runtime {runtime}")
        runtime, clients = runtime or "device", clients or local_peers
        option = [*option, f"device_local_peers={local_peers}"]
    overrides = {
        k: v
        for k, v in dict(
            method=method, attack=attack, defense=defense, dataset=dataset, partitioner=partitioner,
            similarity=similarity, clients=clients, samples_per_client=samples_per_client, rounds=rounds,
            local_steps=local_steps, client_rate=client_rate, data_rate=data_rate, lr=lr, global_lr=global_lr,
            malicious_fraction=malicious_fraction, epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
            clip=clip, neighbouring=neighbouring, accountant=accountant, noise_source=noise_source,
            no_dp=no_dp or None, device_simulation=device_simulation or None, feature_norm=feature_norm,
            eval_fraction=eval_fraction, features=features, model=model, runtime=runtime, seed=seed, time_budget_min=time_budget,
            experiment=experiment,
            tracking_uri=tracking_uri, results_dir=results_dir,
            options={**({"shards_per_client": shards_per_client} if shards_per_client else {}), **parse_key_values(option)} or None,
        ).items()
        if v is not None
    }
    resolved = resolve_config(config, overrides)
    human = Console(stderr=as_json)
    pm = default_plugin_manager()
    result = run(resolved, observers=[ProgressDisplay(Console(stderr=True))], plugin_manager=pm)
    print_summary(human, result.summary)
    if as_json:
        typer.echo(json.dumps(result.summary, default=json_default))


def json_default(value: Any) -> Any:
    """`json.dumps` fallback for summaries: NaN as null, anything else as its string."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=f"{summary['method']} on {summary['dataset']} (seed {summary['seed']})", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("attack / defense", f"{summary['attack'] or 'none'} / {summary['defense'] or 'none'}"),
        ("rounds", _rounds_text(summary)),
        ("reported clients", f"{summary['reported_clients']} of {summary['clients']} (benign, non-evaluation)"),
        ("test accuracy mean", f"{summary['accuracy_mean']:.4f}"),
        ("test accuracy min / max", f"{summary['accuracy_min']:.4f} / {summary['accuracy_max']:.4f}"),
        ("epsilon", _claim_text(summary)),
        ("DP randomness", _randomness_text(summary)),
        ("wall time", f"{summary['wall_time_s']:.2f} s"),
        ("MLflow run", f"{summary.get('run_id')} at {summary.get('tracking_uri')}"),
        ("local results", str(summary.get("results_dir"))),
    ]
    if summary.get("tracking_error"):
        rows.append(("tracking", f"[yellow]{summary['tracking_error']}; results kept locally[/yellow]"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def _rounds_text(summary: dict[str, Any]) -> str:
    if not summary.get("stopped_by_time_budget"):
        return str(summary["rounds"])
    return (f"[yellow]{summary['rounds_completed']} of {summary['rounds']}: stopped by the time budget "
            f"({summary['time_budget_min']:g} min); accuracy of round {summary['rounds_completed']}[/yellow]")


def _claim_text(summary: dict[str, Any]) -> str:
    """The epsilon row: a certified figure plainly; an uncertified one in red, never as a
    plain number; a non-private run says so."""
    if not summary.get("private", summary.get("epsilon") is not None):
        return "[yellow]non-private run: no DP, no epsilon[/yellow]"
    text = _privacy_text(summary)
    if summary.get("epsilon_scope"):  # stopped by the time budget: the epsilon of the rounds taken
        text += f"; epsilon of the {summary['epsilon_scope']}"
    if summary.get("epsilon_certified") is False:
        return f"[bold red]UNCERTIFIED[/bold red] [red]{text}; why: {summary.get('uncertified_reason')}[/red]"
    return f"[green]certified[/green] {text}"


def _randomness_text(summary: dict[str, Any]) -> str:
    from p4bench.privacy.certification import RANDOMNESS_LABELS

    source = "secure" if summary.get("dp_randomness") == "secret" else "seeded"
    return RANDOMNESS_LABELS[source] if summary.get("private") else "n/a"


def _privacy_text(summary: dict[str, Any]) -> str:
    if summary.get("epsilon") is None:
        return "non-private"
    pld = f", {summary['epsilon_pld']:.3f} max (pld)" if summary.get("epsilon_pld") is not None and summary["accountant"] != "pld" else ""
    label = summary["accountant"]
    if label == "noble":
        label += "; bound stated for fixed-size sampling without replacement, runs use Poisson batches"
    return (
        f"{summary['epsilon']:.3f} max / {summary['epsilon_mean']:.3f} mean ({label}), "
        f"{summary['epsilon_rdp']:.3f} max (rdp){pld}; delta {summary['delta']:.2g}, sigma {summary['noise_multiplier']:.3f}, "
        f"{summary['neighbouring']}; {summary['clients_stopped']} clients hit the budget"
    )


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
