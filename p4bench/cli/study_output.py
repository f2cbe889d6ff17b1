"""Consoles and shared printing of the study commands (`p4bench.cli.studies`,
`p4bench.cli.tuning_view`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from p4bench.studies.sweep import SweepReport

__all__ = ["err", "out"]

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _print_sweep_summary(report: SweepReport, console: Console = out) -> None:
    from p4bench.studies.sweep import describe_run

    table = Table(title=f"sweep '{report.name}'", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("runs planned", str(len(report.planned)))
    table.add_row("skipped (already finished)", str(report.count("skipped")))
    table.add_row("finished now", str(report.count("finished")))
    table.add_row(
        "failed", f"[red]{report.count('failed')}[/red]" if report.count("failed") else "0"
    )
    if report.count("incompatible"):
        table.add_row("not runnable (incompatible)", str(report.count("incompatible")))
    table.add_row("MLflow", f"experiment '{report.name}' at {report.tracking_uri}")
    console.print(table)
    from p4bench.tracking.links import where_to_look  # the runs table's link, compare beside it

    for line in where_to_look(report.tracking_uri, experiment=report.name):
        console.print(line, markup=False, highlight=False)
    for notice in report.notices:
        err.print(f"[yellow]notice:[/yellow] {notice}")
    for planned, record in zip(report.planned, report.records):
        if record.status == "incompatible":
            console.print(f"[yellow]not run[/yellow] {describe_run(planned)}: {record.error}")
    for planned, record in report.failures:
        console.print(f"[red]FAILED[/red] {describe_run(planned)}: {record.error}")
    for planned, record in report.untracked:
        console.print(
            f"[yellow]not in MLflow[/yellow] {describe_run(planned)}: {record.summary.get('tracking_error')}; "
            f"results in {record.summary.get('results_dir')}"
        )


def _num(value: float) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"
    )
