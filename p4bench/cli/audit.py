"""`p4bench audit`: an empirical privacy audit of one method and config.

`--level mechanism` (default): gradient canaries inside the DP mechanism
(`p4bench.audit.core`); `--level method`: canary records in the clients' data, read
from what a curious neighbour receives or from the final models
(`p4bench.audit.method_level`, `--observer messages|final`).

`--bound one-run` (default): the one-run bound of Steinke, Nasr and Jagielski's game,
analysed with Mahloujifar et al.'s f-DP recursion on the (eps, delta) curve
(`p4bench.audit.one_run`); `--bound steinke`: the same game with Steinke et al.'s own
p-value; `--bound multi-run`: Jagielski et al.'s test with Clopper-Pearson intervals.

Prints one line (what was checked, the lower bound next to the claimed epsilon, the
ceiling: the bound a perfect separation of the canaries would give, and the wall and CPU
seconds) and, with --json, a last JSON line with the figures (`verdict`: refuted, leaks,
inconclusive or consistent). Exits 0 when the claim is consistent with the audit or the
audit is inconclusive (the ceiling is not above the claim: this audit cannot refute it;
the line says how many runs would lift it), 1 when the lower bound exceeds it (`refuted`:
the claim fails) or, at the method level, the replay checks find records outside the
ledger (`leaks`), 2 for bad input (including a non-private run).

`--plant-fault` checks the audit itself: it plants a known privacy bug in the run's DP
mechanism (`p4bench.testing.audit_faults`), so that the claim is false and the audit
should say so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from p4bench.cli.run import json_default
from p4bench.config import parse_key_values, resolve_config
from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Callable

    from p4bench.privacy.mechanism import DPMechanism
    from p4bench.records import RoundReport, RunInfo

DEFAULT_EXPERIMENT = "p4bench-audit"  # canary-laden runs stay out of the benchmark's experiments
# --plant-fault: the planted bugs of `p4bench.testing.audit_faults`, by name
FAULTS = {
    "clipping-removed": "clipping removed (clip norm 1e12), noise and ledger for the claimed C",
    "sampling-5x": "DP-SGD samples at 5x the rate the ledger records",
}


def planted_fault(name: str | None) -> Callable[[DPMechanism], DPMechanism] | None:
    """The `wrap_mechanism` of `--plant-fault NAME` (None: no fault)."""
    if name is None:
        return None
    from p4bench.errors import UsageError

    if name not in FAULTS:
        raise UsageError(f"--plant-fault must be one of {', '.join(FAULTS)}, got '{name}'")
    from p4bench.testing.audit_faults import oversampled, unclipped

    return unclipped if name == "clipping-removed" else oversampled(5.0)


class RoundProgress:
    """Observer plugin: one bar over every round of every run of the audit."""

    def __init__(self, progress: Progress, task: TaskID, runs: int) -> None:
        self.progress, self.task, self.runs = progress, task, runs
        self.index = 0

    @hookimpl
    def run_started(self, run: RunInfo) -> None:
        self.index += 1
        self.progress.update(
            self.task,
            total=run.total_rounds * self.runs,
            description=f"audit run {self.index}/{self.runs}",
        )

    @hookimpl
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        self.progress.update(self.task, advance=1)


def audit_command(
    method: str = typer.Option(..., help="method name (see `p4bench list`)"),
    dataset: str | None = typer.Option(None, help="dataset name (default digits, offline)"),
    clients: int | None = typer.Option(None, help="number of clients M"),
    rounds: int | None = typer.Option(None, help="communication rounds T"),
    local_steps: int | None = typer.Option(None, help="local steps K per round"),
    data_rate: float | None = typer.Option(None, help="data sampling ratio s in (0, 1]"),
    epsilon: float | None = typer.Option(
        None, help="target epsilon per client (the claim to audit)"
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
    seed: int | None = typer.Option(
        None, help="seed of the first run (runs use seed..seed+runs-1)"
    ),
    option: list[str] = typer.Option(
        [], "--option", "-o", help="plugin option KEY=VALUE (repeatable)"
    ),
    runs: int = typer.Option(1, "--runs", help="training runs; their trials are pooled"),
    canaries_per_client: int | None = typer.Option(
        None,
        "--canaries-per-client",
        help="canaries per client (mechanism level: default min(parameters, 1024), at most "
        "the parameters; method level: default 50)",
    ),
    level: str = typer.Option(
        "mechanism",
        "--level",
        help="mechanism (gradient canaries in the DP mechanism) | method "
        "(canary records through the whole method)",
    ),
    observer: str = typer.Option(
        "messages",
        "--observer",
        help="method level: messages (what a curious neighbour or "
        "the server receives) | final (the final deployed models)",
    ),
    confidence: float = typer.Option(
        0.95, "--confidence", help="confidence of the lower bound, in (0, 1)"
    ),
    bound: str = typer.Option(
        "one-run",
        "--bound",
        help="one-run (Steinke et al.'s game, f-DP analysis: one run "
        "can refute a claim of 8) | steinke (the same game, their p-value) | multi-run "
        "(Jagielski et al., Clopper-Pearson)",
    ),
    plant_fault: str | None = typer.Option(
        None,
        "--plant-fault",
        help="check the audit itself: plant a privacy bug "
        "in the mechanism (" + " | ".join(FAULTS) + "), so the claim is false",
    ),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="PNG of the score distributions (default: in the last run's results folder)",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="end with one JSON line holding the figures"
    ),
    tracking_uri: str | None = typer.Option(
        None, help="MLflow tracking URI (default: SQLite in the results dir)"
    ),
    experiment: str | None = typer.Option(
        None, help=f"MLflow experiment name (default {DEFAULT_EXPERIMENT})"
    ),
    results_dir: str | None = typer.Option(None, help="folder for local copies of results"),
) -> None:
    """Empirical privacy audit: an epsilon lower bound from canaries, next to the claimed epsilon."""
    from p4bench.audit.core import run_audit
    from p4bench.audit.method_level import OBSERVERS, run_method_audit
    from p4bench.audit.one_run import BOUNDS
    from p4bench.errors import UsageError
    from p4bench.host.manager import default_plugin_manager

    if level not in ("mechanism", "method"):
        raise UsageError(f"--level must be mechanism or method, got '{level}'")
    if observer not in OBSERVERS:
        raise UsageError(f"--observer must be one of {', '.join(OBSERVERS)}, got '{observer}'")
    if level == "mechanism" and observer != "messages":
        raise UsageError(
            "--observer applies to --level method (the mechanism level observes the noisy releases)"
        )
    if bound not in BOUNDS:
        raise UsageError(f"--bound must be one of {', '.join(BOUNDS)}, got '{bound}'")
    fault = planted_fault(plant_fault)

    overrides = {
        k: v
        for k, v in dict(
            method=method,
            dataset=dataset,
            clients=clients,
            rounds=rounds,
            local_steps=local_steps,
            data_rate=data_rate,
            epsilon=epsilon,
            delta=delta,
            noise_multiplier=noise_multiplier,
            clip=clip,
            neighbouring=neighbouring,
            accountant=accountant,
            seed=seed,
            tracking_uri=tracking_uri,
            experiment=experiment or DEFAULT_EXPERIMENT,
            results_dir=results_dir,
            options=parse_key_values(option) or None,
        ).items()
        if v is not None
    }
    config = resolve_config(overrides=overrides)
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("audit", total=None)
        common = dict(
            runs=runs,
            canaries_per_client=canaries_per_client,
            confidence=confidence,
            bound=bound,
            wrap_mechanism=fault,
            observers=[RoundProgress(progress, task, runs)],
            plugin_manager=default_plugin_manager(),
            plot=plot,
        )
        if level == "method":
            result = run_method_audit(config, observer=observer, **common)  # type: ignore[arg-type]
        else:
            result = run_audit(config, **common)  # type: ignore[arg-type]
    human = Console(stderr=as_json, highlight=False, soft_wrap=True)
    if plant_fault is not None:
        human.print(
            f"note: planted fault '{plant_fault}': {FAULTS[plant_fault]} (the claim is false)"
        )
    for note in result.notes:
        human.print(f"note: {note}")
    if result.tracking_error:
        human.print(f"[yellow]{result.tracking_error}[/yellow]")
    if result.plot is not None:
        human.print(f"score distributions: {result.plot}")
    typer.echo(result.line())
    if as_json:
        typer.echo(json.dumps(result.as_dict(), default=json_default))
    if result.exceeds or result.leaks:
        raise typer.Exit(1)


def inversion_command(
    epsilon: list[float] = typer.Option(
        [8.0, 1.0], "--epsilon", help="PDSL's calibrated sigma at these epsilons (T rounds, rate 1)"
    ),
    rounds: int = typer.Option(30, "--rounds", min=1, help="T, for the calibration"),
    batch: int = typer.Option(11, "--batch", min=1, help="the victim's batch size"),
    degree: int = typer.Option(
        20, "--degree", min=1, help="|M_i|: the victim's gradients per release"
    ),
    trials: int = typer.Option(5, "--trials", min=1, help="victim batches per noise level"),
    plot: str = typer.Option(
        "inversion.png", "--plot", help="PNG of true vs reconstructed class means"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """PDSL's malicious neighbour: send the zero model (`model-probe`), invert the victim's
    returned cross-gradient on digits, and score the reconstruction at no DP, small sigmas
    and the sigmas PDSL calibrates for each --epsilon."""
    from p4bench.audit.inversion import inversion_experiment

    result = inversion_experiment(
        epsilons=tuple(epsilon),
        rounds=rounds,
        batch_size=batch,
        degree=degree,
        trials=trials,
        plot=plot,
    )
    for line in result.lines():
        typer.echo(line)
    if as_json:
        typer.echo(json.dumps(result.as_dict(), default=json_default))


def register(app: typer.Typer) -> None:
    """Add the `audit` and `audit-inversion` commands to the p4bench app."""
    app.command("audit")(audit_command)
    app.command("audit-inversion")(inversion_command)
