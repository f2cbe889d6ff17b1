"""`p4bench compare --plot` (`plot_comparison`): accuracy per round
per group, the final metric per group and, where the runs are private, epsilon over rounds
and the final metric against the final epsilon.

Uncertainty is a 95% t interval over a group's runs (`p4bench.studies.intervals`): a band
around a curve where at least two runs reached the round, an error bar where n >= 2; a
group of one run gets no bar, and the chart says so ("n=1" over its bar, and in the panel's
title). The figure's title names the attack and defense (one value each, or "per group"
when they vary: they are group keys then, `compare.keep_settings_apart`); the legend stands
outside the panels, on the right. The epsilon axis never zooms into accounting noise: when
the groups' final epsilons lie within `NOISE` of each other (7.9928-7.9942 for a target of
8) they are one setting on an axis padded to +-10% around it, and the label says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p4bench.studies.compare import CURVE_METRIC, Comparison, column_for
from p4bench.studies.intervals import half_width

__all__ = ["EPSILON_METRIC", "NOISE", "epsilon_axis", "group_label", "plot_comparison", "threats"]

EPSILON_METRIC = "epsilon_max"  # logged every round by private runs: the largest reported client's epsilon so far
NOISE = 0.02  # final epsilons within this relative spread are one setting (accounting noise)


def group_label(row: Any, keys: Sequence[str]) -> str:
    return ", ".join(str(row[k]) if len(keys) > 2 else f"{k}={row[k]}" for k in keys)


def threats(runs: Any) -> str:
    """`attack none, defense none`; a threat that varies: `defense per group (3: ...)`."""
    parts = []
    for name in ("attack", "defense"):
        if name not in runs:
            continue
        values = list(dict.fromkeys(runs[name].fillna("none").astype(str)))
        if len(values) == 1:
            parts.append(f"{name} {values[0]}")
        else:
            shown = ", ".join(values[:4]) + (", ..." if len(values) > 4 else "")
            parts.append(f"{name} per group ({len(values)}: {shown})")
    return ", ".join(parts)


def epsilon_axis(values: Sequence[float]) -> tuple[float, float, str]:
    """(low, high, note) of an epsilon axis: padded by 8% of the span, or, where the values
    differ by accounting noise only (`NOISE`), +-10% (at least 0.5) around them, noted."""
    low, high = min(values), max(values)
    if high - low <= NOISE * max(abs(high), 1e-12):
        centre = (low + high) / 2
        pad = max(0.1 * abs(centre), 0.5)
        digits = next(d for d in range(4, 12) if f"{low:.{d}g}" != f"{high:.{d}g}" or d == 11)
        note = (
            f"; all within {low:.{digits}g}-{high:.{digits}g}: one setting, accounting noise"
            if len(values) > 1 and high > low
            else ""
        )
        return max(0.0, centre - pad), centre + pad, note
    pad = 0.08 * (high - low)
    return max(0.0, low - pad), high + pad, ""


def _band(axis: Any, frame: Any, name: str, colour: str) -> None:
    """A group's per-round mean over its runs, with its 95% t band where at least two runs
    reached the round (none for one run)."""
    if frame.empty:
        return
    stats = frame.groupby("step")["value"].agg(["mean", "std", "count"]).reset_index()
    half = [half_width(s, int(n)) for s, n in zip(stats["std"], stats["count"])]
    axis.plot(stats["step"], stats["mean"], marker="o", markersize=2, label=name, color=colour)
    if any(h == h for h in half):
        spread = [h if h == h else 0.0 for h in half]
        axis.fill_between(
            stats["step"],
            stats["mean"] - spread,
            stats["mean"] + spread,
            where=[h == h for h in half],
            alpha=0.15,
            color=colour,
        )


def _bars(bars: Any, table: Any, colours: list[str], names: list[str], metric: str) -> None:
    """The final metric per group: mean, 95% t error bar where n >= 2, "n=1" where not."""
    means = [float(m) for m in table["mean"]]
    halves = [half_width(float(s), int(n)) for s, n in zip(table["std"], table["n"])]
    bars.bar(range(len(table)), means, color=colours)
    drawn = [i for i, h in enumerate(halves) if h == h]
    if drawn:
        bars.errorbar(
            drawn,
            [means[i] for i in drawn],
            yerr=[halves[i] for i in drawn],
            fmt="none",
            ecolor="black",
            capsize=3,
        )
    single = [i for i, n in enumerate(table["n"]) if int(n) < 2]
    for i in single:
        bars.annotate("n=1", (i, means[i]), ha="center", va="bottom", fontsize=7)
    bars.set_xticks(range(len(table)), names, rotation=45, ha="right", fontsize=7)
    bars.set_ylabel(metric)
    bars.grid(alpha=0.3, axis="y")
    bars.set_title(
        "final: mean, 95% t interval"
        + (f"; n=1, no error bar: {len(single)} of {len(table)} groups" if single else ""),
        fontsize=8,
    )


def plot_comparison(
    comparison: Comparison, out: str | Path, curve_metric: str = CURVE_METRIC
) -> Path:
    """Accuracy-per-round curves per group (mean, 95% band over seeds) next to a bar chart
    of the final metric (mean, 95% error bars where n >= 2); where the runs are private, also
    epsilon over rounds and the final metric against the final epsilon. Saved as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import pandas as pd

    from p4bench.studies.results import metric_history

    runs, keys = comparison.runs, comparison.group_by
    labels = runs.apply(
        lambda r: group_label(
            {
                k: str(r[column_for(runs, k)]) if pd.notna(r[column_for(runs, k)]) else "-"
                for k in keys
            },
            keys,
        ),
        axis=1,
    )
    groups = pd.DataFrame({"run_id": runs["run_id"], "group": labels})
    history = metric_history(comparison.tracking_uri, runs["run_id"], curve_metric)
    history = history.merge(groups, on="run_id")
    table = comparison.table
    names = [group_label(row, keys) for row in table.to_dict("records")]
    colours = [f"C{i % 10}" for i in range(len(names))]  # one colour per group in every panel
    epsilons = metric_history(comparison.tracking_uri, runs["run_id"], EPSILON_METRIC)
    epsilons = epsilons.merge(groups, on="run_id")
    private = not epsilons.empty
    if private:  # epsilon over rounds and accuracy against epsilon beside the accuracy
        fig, grid = plt.subplots(2, 2, figsize=(12, 8.5), dpi=100)
        (curves, bars), (spent, tradeoff) = grid
    else:
        fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for name, colour in zip(names, colours):
        _band(curves, history[history["group"] == name], name, colour)
        if private:
            _band(spent, epsilons[epsilons["group"] == name], name, colour)
    curves.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    curves.set_xlabel("round")
    curves.set_ylabel(f"{curve_metric} (reported clients)")
    curves.set_ylim(0, 1)
    curves.grid(alpha=0.3)
    curves.set_title("per round: mean over runs, 95% t band where n >= 2", fontsize=8)
    _bars(bars, table, colours, names, comparison.metric)
    if private:
        spent.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        spent.set_xlabel("round")
        spent.set_ylabel("epsilon spent (largest client)")
        spent.grid(alpha=0.3)
        final = (
            epsilons.sort_values("step").groupby("run_id").tail(1).groupby("group")["value"].mean()
        )
        shown = [
            (row, name, colour)
            for row, name, colour in zip(table.to_dict("records"), names, colours)
            if name in final.index
        ]
        for row, name, colour in shown:
            half = half_width(float(row["std"]), int(row["n"]))
            tradeoff.errorbar(
                final[name],
                row["mean"],
                yerr=half if half == half else None,
                marker="o",
                capsize=3,
                color=colour,
                label=name,
            )
        note = ""
        if shown:
            low, high, note = epsilon_axis([float(final[name]) for _, name, _ in shown])
            tradeoff.set_xlim(low, high)
        tradeoff.ticklabel_format(axis="x", style="plain", useOffset=False)
        tradeoff.set_xlabel(f"epsilon at the end (largest client){note}")
        tradeoff.set_ylabel(comparison.metric)
        tradeoff.grid(alpha=0.3)
        tradeoff.set_title("final metric against final epsilon (95% t intervals)", fontsize=8)
    fig.suptitle(
        f"{comparison.experiment}: {threats(runs) or 'no attack recorded'}\n"
        "mean over seeds with 95% t intervals (none where a group has one run)",
        fontsize=10,
    )
    fig.tight_layout()
    handles, texts = curves.get_legend_handles_labels()
    if handles:  # outside the panels, right of them: never over a curve
        fig.legend(
            handles,
            texts,
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            fontsize=7,
            ncol=1 if len(handles) <= 24 else 2,
            title="group",
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out
