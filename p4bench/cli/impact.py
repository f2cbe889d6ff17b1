"""`p4bench impact`: attack impact and ideal-defense gap per method, attack and defense,
from an experiment's MLflow runs (an adapter over `p4bench.studies.impact`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from p4bench.studies.impact import DEFAULT_METRIC, compute_impact, format_table, plot_impact

__all__ = ["impact_command", "register"]


def impact_command(
    experiment: str,
    tracking_uri: str | None,
    results_dir: str,
    metric: str,
    plot: Path | None,
    csv: Path | None,
    as_json: bool,
    allow_mixed_privacy: bool = False,
) -> None:
    """Adapter behind `p4bench impact`."""
    from p4bench.tracking.stores import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(results_dir)
    paired, table = compute_impact(experiment, uri, metric, allow_mixed_privacy)
    plot = plot or Path(results_dir) / f"impact-{experiment}.png"
    plot_impact(table, plot, title=f"attack impact, experiment {experiment} ({metric})")
    if csv is not None:
        table.to_csv(csv, index=False)
    missing = int(paired["clean_accuracy"].isna().sum())
    verdict = table.attrs.get("privacy")
    if verdict is not None and verdict.warning:
        typer.echo(f"warning: {verdict.warning}", err=True)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "experiment": experiment,
                    "metric": metric,
                    "plot": str(plot),
                    "unpaired_attacked_runs": missing,
                    "rows": json.loads(table.to_json(orient="records")),
                }
            )
        )
        return
    typer.echo(format_table(table))
    if verdict is not None and any(r.private for r in verdict.runs):
        typer.echo(verdict.note())
    if missing:
        typer.echo(
            f"{missing} attacked run(s) have no unattacked run of the same config and seed (impact shown as -)"
        )
    typer.echo(f"bar chart: {plot}")


def register(app: typer.Typer) -> None:
    """Add the `impact` command to the p4bench app."""

    def impact(
        experiment: str = typer.Option(
            ..., help="MLflow experiment holding the attacked, unattacked and ideal-defense runs"
        ),
        tracking_uri: str | None = typer.Option(
            None, help="MLflow tracking URI (default: SQLite in the results dir)"
        ),
        results_dir: str = typer.Option(
            "p4bench-runs", help="results folder (default store and plot location)"
        ),
        metric: str = typer.Option(DEFAULT_METRIC, help="benign-accuracy metric to compare"),
        plot: Path | None = typer.Option(
            None, help="PNG for the bar chart (default <results-dir>/impact-<experiment>.png)"
        ),
        csv: Path | None = typer.Option(None, help="also write the table as CSV here"),
        as_json: bool = typer.Option(False, "--json", help="print the table as one JSON object"),
        allow_mixed_privacy: bool = typer.Option(
            False,
            "--allow-mixed-privacy",
            help="compare private runs under different neighbouring relations or uncertified epsilons, marked",
        ),
    ) -> None:
        """Attack impact (no attack - attack) and ideal-defense gap (ideal - defense) per
        method, attack and defense, averaged over seeds, with a bar chart. Private runs must
        share one neighbouring relation and be certified (else exit 2, naming them)."""
        impact_command(
            experiment, tracking_uri, results_dir, metric, plot, csv, as_json, allow_mixed_privacy
        )

    app.command("impact")(impact)
