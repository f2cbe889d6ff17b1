"""The `p4l` preset's report (`p4bench_p4l.preset`): the factor-effect computation of
claim (b) printed line by line, the paper's R2 figures as reference values only, claim (c)
(R1: the test loss drops within the first 5 participations) from the runs'
`participation_curve.csv`, and two plots: mean accuracy per factor level, and accuracy
against the participation count r per synergy size (skipped when no run left a curve).

The curves are read from the results folder: the runs whose `config.yaml` names the
preset's experiment, the latest folder of each config hash (a resumed sweep reruns nothing;
a rerun config counts once, as in the table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from p4bench.studies.claims import ClaimCheck, ClaimContext, not_checked, pct
from p4bench.studies.intervals import decide, interval
from p4bench.studies.presets import Preset
from p4bench_p4l.preset import (
    CLASSICAL,
    GROUP_BY,
    SIZES,
    TUNE_GRID,
    FactorEffect,
    factor_effects,
    p4l_per_method,
    p4l_settings,
    p4l_variants,
    partition_level,
    size_level,
)
from p4bench_p4l.preset_claims import p4l_claims

__all__ = [
    "P4L_PRESET",
    "R2",
    "load_curves",
    "loss_drop_claim",
    "p4l_report",
    "plot_factor_levels",
    "plot_participation",
    "reference_lines",
]

R2 = {
    "P4L, IID": 0.47,
    "classical (centralized)": 0.58,
}  # CIFAR-10, MobileNetV2 head: reference values only
R1_DROP, R1_LAST = (
    0.20,
    5,
)  # "loss drops ~20% within the first 5 iterations" (CIFAR-10 IID, sz 3-10)
Curve = tuple[dict[str, Any], Any]  # (the run's config, its participation curve as a DataFrame)


def reference_lines(table: Any, effects: list[FactorEffect], dataset: str = "digits") -> list[str]:
    """Claim (b)'s computation, then R2's accuracies beside ours on `dataset` (not
    comparable: another dataset and model)."""
    lines = [
        "factor effects (claim b): mean final accuracy per level, seeds averaged first, plaintext runs"
    ]
    lines += [f"  {effect.line()}" for effect in effects]
    attack = next(
        (e.levels for e in effects if e.factor == "attack"), {}
    )  # "none": P4L, IID, power law
    classical = (
        table[table["variant"].astype(str) == CLASSICAL]["mean"].tolist()
        if table is not None
        else []
    )
    ours = {
        "P4L, IID": attack.get("none", float("nan")),
        "classical (centralized)": sum(classical) / len(classical) if classical else float("nan"),
    }
    lines.append(
        f"R2 of the paper (CIFAR-10, IID) beside ours ({dataset}, linear model): reference values only, not "
        "comparable and not a verdict"
    )
    for row, paper in R2.items():
        lines.append(f"  {row:<24} paper {100 * paper:.1f}%   ours {pct(ours[row]):>6}")
    return lines


# -- participation curves -----------------------------------------------------------------------


def load_curves(folder: Path, experiment: str) -> list[Curve]:
    """(config, curve) of every run of `experiment` under `folder` that wrote
    `participation_curve.csv`, the latest folder per config hash."""
    import pandas as pd

    latest: dict[str, Curve] = {}
    for path in sorted(Path(folder).glob("*/participation_curve.csv")):
        config_file, summary_file = path.parent / "config.yaml", path.parent / "summary.json"
        if not config_file.is_file():
            continue
        config = yaml.safe_load(config_file.read_text()) or {}
        if config.get("experiment") != experiment:
            continue
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        latest[str(summary.get("config_hash", path.parent.name))] = (config, pd.read_csv(path))
    return list(latest.values())


def _option(config: dict[str, Any], name: str, default: Any = None) -> Any:
    return (config.get("options") or {}).get(name, default)


def _clean(config: dict[str, Any]) -> bool:
    """A plaintext P4L run without attack (the grid's and the HE block's plaintext runs)."""
    return (
        config.get("method") == "p4l"
        and config.get("attack") in (None, "none")
        and _option(config, "crypto", "paillier") == "plaintext"
    )


def loss_drop_claim(curves: list[Curve], quick: bool = False, last: int = R1_LAST) -> ClaimCheck:
    """(c) R1: on the IID power-law runs without attack, the test loss after `last`
    participations is below that after the first (r = 1): the relative drop per seed, its
    95% t interval above 0."""
    claim = (
        f"the test loss drops from r = 1 to r = {last} participations, IID, power-law sizes, no attack "
        "(R1; the paper: CIFAR-10, ~20%)"
    )
    drops = {}
    for config, curve in curves:
        if not (
            _clean(config)
            and config.get("partitioner") == "iid"
            and _option(config, "size_dist") == "powerlaw"
        ):
            continue
        loss = dict(zip(curve["r"].astype(int), curve["loss"].astype(float)))
        if 1 in loss and last in loss:
            drops[str(config.get("seed", 0))] = 1 - loss[last] / loss[1]
    if not drops:
        return not_checked(
            claim, f"needs participation curves reaching r = {last} (participation_curve.csv)"
        )
    found = interval(drops.values())
    status, reason = decide(found)
    detail = (
        ", ".join(f"seed {s}: {100 * d:.1f}%" for s, d in sorted(drops.items()))
        + f" relative drop; mean {found.text(unit='%')}; {reason}; the paper: ~{100 * R1_DROP:.0f}% on "
        "CIFAR-10 (reference only)"
    )
    if quick:
        return ClaimCheck(claim, "not tested", f"quick smoke run; figures: {detail}")
    return ClaimCheck(claim, status, detail, interval=found, seeds_needed=found.seeds_needed())


def _mean_curve(curves: list[Any]) -> tuple[list[int], list[float]]:
    """Mean accuracy over runs at each r, up to the last r where every run still has at
    least half its r = 1 peers (the paper's mrr = 0.5: beyond it a few peers decide)."""
    tops = []
    for curve in curves:
        kept = curve[curve["peers"] >= 0.5 * curve["peers"].iloc[0]]
        tops.append(int(kept["r"].max()) if len(kept) else 0)
    xs = list(range(1, min(tops) + 1)) if tops else []
    ys = [
        sum(float(c.loc[c["r"] == r, "accuracy"].iloc[0]) for c in curves) / len(curves) for r in xs
    ]
    return xs, ys


def plot_participation(curves: list[Curve], path: Path, title: str) -> Path | None:
    """Accuracy against r per synergy size (IID solid, non-IID dashed), no-attack
    plaintext runs, seeds averaged; per size and split only the runs of the longest
    horizon (the grid's, not the HE block's 10 rounds); None without curves."""
    found: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for config, curve in curves:
        if _clean(config) and len(curve):
            key = (
                size_level(_option(config, "size_dist"), _option(config, "size", 5)),
                partition_level(config.get("partitioner")),
            )
            found.setdefault(key, []).append((int(config.get("rounds", 0)), curve))
    groups = {k: [c for r, c in runs if r == max(r for r, _ in runs)] for k, runs in found.items()}
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    order = {size: i for i, size in enumerate(SIZES)}  # the sizes' own order, not the text's
    sizes = sorted({size for size, _ in groups}, key=lambda size: order.get(size, len(order)))
    for size, partition in sorted(groups, key=lambda k: (sizes.index(k[0]), k[1])):
        xs, ys = _mean_curve(groups[(size, partition)])
        axes.plot(
            xs,
            ys,
            linestyle="-" if partition == "IID" else "--",
            marker=".",
            color=f"C{sizes.index(size)}",
            label=f"{size}, {partition}",
        )
    axes.set_xlabel("participation count r (completed synergies)")
    axes.set_ylabel("test accuracy, peers with >= r")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(title, fontsize=9)
    return _save(fig, plt, path)


def plot_factor_levels(effects: list[FactorEffect], path: Path, title: str) -> Path | None:
    """One panel per factor: mean accuracy per level (claim b's figures); None without any."""
    shown = [e for e in effects if e.levels]
    if not shown:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(shown), figsize=(3.2 * len(shown), 3.6), dpi=100, squeeze=False, sharey=True
    )
    low = min(v for e in shown for v in e.levels.values())
    for ax, effect in zip(axes[0], shown):
        ax.bar(range(len(effect.levels)), list(effect.levels.values()), color="C0")
        ax.set_xticks(
            range(len(effect.levels)), list(effect.levels), rotation=35, ha="right", fontsize=7
        )
        ax.set_ylim(
            max(0.0, low - 0.1), 1
        )  # one zoomed scale: the spreads are what the claim compares
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{effect.factor} (spread {100 * effect.spread:.1f} points)", fontsize=8)
    axes[0][0].set_ylabel("mean final accuracy")
    fig.suptitle(title, fontsize=9)
    return _save(fig, plt, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def p4l_report(table: Any, ctx: ClaimContext, folder: Path, experiment: str) -> list[str]:
    """Lines printed after the table: claim (b)'s computation, R2 beside ours, claim (c)
    from the curves (printed here, since the claims below see only the table), plots."""
    effects = factor_effects(table) if table is not None else []
    lines = reference_lines(table, effects, ctx.dataset)
    curves = load_curves(folder, experiment)
    r1 = loss_drop_claim(curves, ctx.quick)
    lines.append(
        f"claim (c), from the runs' participation curves: {r1.claim}: {r1.status}"
        + (f" ({r1.detail})" if r1.detail else "")
    )
    levels = plot_factor_levels(
        effects,
        folder / f"{experiment}-factor-levels.png",
        f"{experiment}: accuracy by factor level",
    )
    lines.append(
        f"plot of accuracy by factor level: {levels}"
        if levels
        else "plot of accuracy by factor level: no run finished"
    )
    curve_plot = plot_participation(
        curves,
        folder / f"{experiment}-accuracy-vs-r.png",
        f"{experiment}: accuracy vs participation count r, no attack",
    )
    lines.append(
        f"plot of accuracy vs participation count r: {curve_plot}"
        if curve_plot
        else "plot of accuracy vs participation count r: skipped (no participation_curve.csv in the runs' folders)"
    )
    return lines


P4L_PRESET = Preset(
    "p4l",
    "Arapakis et al. (P4L): synergy size, IID vs non-IID, Paillier vs plaintext and Byzantine % x "
    "attack; digits stands in for CIFAR-10/Avito/IMDB (not available offline); no DP",
    ("digits", "mnist"),
    {},
    p4l_variants,
    GROUP_BY,
    p4l_claims,
    settings=p4l_settings,
    per_method_for=p4l_per_method,
    tune_at={
        "variant": "synergy size x IID",
        "partitioner": "iid",
        "options.size_dist": "powerlaw",
    },
    tune_grid=TUNE_GRID,
    report=p4l_report,
    baselines="every run is non-private, as in the paper (P4L uses secure aggregation, no DP): no epsilon to "
    "equalise; classical (centralized training) is the non-private pooled ceiling, a reference row no claim uses",
    eval_set="global",
)
