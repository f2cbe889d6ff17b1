"""How `p4bench tune` and `p4bench reproduce` print their tuning: the points' scores, the lr
every partition's runs used, the lines on privacy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from p4bench.cli.study_output import _num, _print_sweep_summary, err, out

if TYPE_CHECKING:
    from p4bench.studies.reproduce import ReproduceReport
    from p4bench.studies.tune import TuneResult

__all__ = ["print_tuning", "print_reproduce_tuning"]


def print_tuning(result: TuneResult, over: str, notes: bool = True) -> None:
    """One table per tuned method (or key): every point's score, the best marked; a
    `privacy` column where the candidates' privacy marks differ; with `notes`, the lines
    saying which federation tuning used (what that means for privacy) and the tuning runs'
    own privacy."""
    from p4bench.studies.tune_scope import tuning_lines

    verdict = result.privacy
    if verdict is not None and verdict.warning:
        err.print(f"[yellow]warning:[/yellow] {verdict.warning}", highlight=False)
    marked = verdict is not None and verdict.needs_column
    for method_name, points in result.points.items():
        table = Table(
            title=f"{method_name}: mean final accuracy of the evaluation clients ({over})"
        )
        keys = list(result.spec.grids[method_name])
        for column in [*keys, *(["privacy"] if marked else []), "mean", "std", "n", ""]:
            table.add_column(column)
        for point in points:
            chosen = point.values == result.best.get(method_name)
            table.add_row(
                *[str(point.values[k]) for k in keys],
                *([point.privacy] if marked else []),
                _num(point.mean),
                _num(point.std),
                str(len(point.scores)),
                "[green]best[/green]" if chosen else "",
            )
        out.print(table)
    if notes:
        for line in tuning_lines(result):
            out.print(line, highlight=False, markup=False)


def print_reproduce_tuning(report: ReproduceReport) -> None:
    """reproduce's tuning: every point's score per tuned method (preset scope), or the lr
    every partition's runs used where it differs (partition scope); the lrs per method."""
    from p4bench.studies.tune_scope import PARTITION, lr_summary, lr_table

    plan = getattr(report, "tuning_plan", None)
    if report.tuning is not None:
        _print_sweep_summary(report.tuning.report, err)
        alone = report.tuning.spec.tune_on == "evaluation-clients"
        if plan is None or plan.scope != PARTITION:
            print_tuning(
                report.tuning,
                "lr tuned on the evaluation clients alone"
                if alone
                else "lr tuned in the whole federation, reported clients' test data withheld",
                notes=False,
            )  # report.privacy states them below
        table = lr_table(plan, report.tuned_lr) if plan is not None else None
        if table is not None:  # a line per partition: readable at any width, however many methods
            header, rows = table
            out.print(
                "lr per partition (tuned on its evaluation clients alone):"
                if alone
                else "lr per partition (tuned in its whole federation):",
                highlight=False,
            )
            for row in rows:
                out.print(
                    f"  {row[0]}: "
                    + ", ".join(f"{key} {lr}" for key, lr in zip(header[1:], row[1:]) if lr),
                    highlight=False,
                    markup=False,
                )
    if report.tuned_lr:
        per = " per partition" if plan is not None and plan.scope == PARTITION else ""
        lrs = (
            lr_summary(plan, report.tuned_lr)
            if plan is not None
            else ", ".join(f"{k} {v:g}" for k, v in report.tuned_lr.items())
        )
        out.print(f"lr per method (tuned{per}): {lrs}", highlight=False)
    staged = getattr(report, "staged", None)
    if staged is not None and staged.outcomes:
        out.print("tuned one option at a time (evaluation clients' mean accuracy per value):")
        for line in staged.lines():
            out.print(f"  {line}", highlight=False, markup=False)
