"""What a preset's claim checks share (`p4bench reproduce`): each check turns a preset's
aggregated table (group keys, mean, std, n; key values as text) and its runs
(`ClaimContext.runs`: group keys, seed, value) into yes / no / inconclusive / not checked /
not tested lines with the figures behind them. The checks themselves live beside each
paper's methods (`p4bench_p4.claims`, the karras, pdsl and p4l presets) and a third-party
preset uses these helpers the same way.

A verdict rests on paired differences over seeds (`p4bench.studies.intervals`): `per_seed`
reads one side's value per seed, `cell` turns two sides into one paired comparison (95% t
interval, three-way verdict against the claim's margin) and `from_cells` joins a claim's
cells ("at every level": yes only if every cell says yes, no if one says no; "in most
cases": yes if more than half say yes, no once half or more say no). `means` and `verdict`
(strict comparisons of means, no interval) stay for presets written against 0.1.

Declared reference rows (a `reference` key: a paper's uncertified variant, a non-private
ceiling; `p4bench.studies.sweep_plan.REFERENCE`) are never a side of a claim:
`without_references` drops them from the table `reproduce` hands a preset's claims, and
`run_values` and `seed_runs` from the runs they pair, so a reference `p4` row can never be
read as `p4`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p4bench.moved import forward_moved
from p4bench.studies.intervals import Interval, decide, equivalent, paired

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Cell",
    "ClaimCheck",
    "ClaimContext",
    "cell",
    "from_cells",
    "joined",
    "means",
    "not_checked",
    "not_tested_on",
    "pct",
    "per_seed",
    "run_values",
    "seed_runs",
    "verdict",
    "without_references",
]

REFERENCE = "reference"  # the key of a declared reference row (`sweep_plan.REFERENCE`)


@dataclass(frozen=True)
class ClaimCheck:
    claim: str
    # yes | no | inconclusive (the interval covers the margin, or too few seeds) | not checked
    # | not tested (a quick smoke run, or the claim is about a dataset that did not run)
    status: str
    detail: str = ""
    training: bool = True  # False: computed without training runs, so a quick run's verdict stands
    interval: Interval | None = None  # the paired difference that decided the verdict
    seeds_needed: int | None = None  # inconclusive: seeds a decisive verdict would need


@dataclass(frozen=True)
class ClaimContext:
    dataset: str
    quick: bool
    skipped: tuple[str, ...]  # "kind 'name'" of unregistered plugins
    runs: Any = None  # pandas DataFrame: the table's group keys (text), `seed`, `value`


def means(table: pd.DataFrame, **where: Any) -> dict[tuple[Any, ...], float]:
    """{remaining key values: mean} of the rows matching `where` (values compared as text);
    the `privacy` mark column (p4bench.studies.equal_privacy) is not a key."""
    rows = table
    for key, value in where.items():
        rows = rows[rows[key].astype(str) == str(value)]
    marks = [c for c in ("privacy",) if c in rows.columns]
    keys = rows.drop(columns=["mean", "std", "n", *where, *marks]).itertuples(index=False)
    return {tuple(k): float(m) for k, m in zip(keys, rows["mean"])}


def pct(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def not_checked(claim: str, reason: str) -> ClaimCheck:
    return ClaimCheck(claim, "not checked", reason)


def verdict(claim: str, failures: list[str], checked: int, passed_detail: str) -> ClaimCheck:
    if not checked:
        return not_checked(claim, "no results to compare")
    return ClaimCheck(
        claim, "no" if failures else "yes", "; ".join(failures) if failures else passed_detail
    )


# -- paired verdicts over seeds (`p4bench.studies.intervals`) ------------------------------


def run_values(comparison: Any) -> pd.DataFrame:
    """A `p4bench.studies.compare.Comparison`'s runs as `ClaimContext.runs`: its group keys
    as text (as in its table), each run's `seed` and `value` (the compared metric)."""
    import pandas as pd

    from p4bench.studies.compare import column_for

    runs, keys = comparison.runs, list(comparison.group_by)
    frame = pd.DataFrame({k: runs[column_for(runs, k)].fillna("-").astype(str) for k in keys})
    frame["seed"] = runs[column_for(runs, "seed")].fillna("-").astype(str)
    frame["value"] = pd.to_numeric(runs[f"metrics.{comparison.metric}"], errors="coerce")
    return without_references(frame.dropna(subset=["value"]).reset_index(drop=True))


def without_references(frame: pd.DataFrame) -> pd.DataFrame:
    """A table's (or its runs') rows a claim may use: the declared reference rows (a
    `reference` value other than `-`) dropped, and the `reference` column with them."""
    if frame is None or REFERENCE not in frame.columns:
        return frame
    marked = frame[REFERENCE].fillna("-").astype(str).str.strip()
    kept = frame[marked.isin(["-", "", "none", "nan"])]
    return kept.drop(columns=[REFERENCE]).reset_index(drop=True)


def seed_runs(table: pd.DataFrame, ctx: ClaimContext | None) -> pd.DataFrame:
    """The runs a claim pairs: `ctx.runs`; without them (a table built by hand, a 0.1
    caller) the table's rows, one run each where it has a `seed` key, else its means as one
    pseudo-seed `-` (n = 1: every paired verdict is inconclusive); declared reference rows
    never (`without_references`)."""
    if ctx is not None and ctx.runs is not None:
        return without_references(ctx.runs)
    frame = table.drop(columns=[c for c in ("std", "n") if c in table.columns])
    frame = without_references(frame.rename(columns={"mean": "value"}))
    return frame if "seed" in frame.columns else frame.assign(seed="-")


def per_seed(runs: pd.DataFrame, **where: Any) -> dict[str, float]:
    """{seed: value} of the runs matching `where` (values compared as text; the mean where
    one seed has several runs, which a caller pinning the whole setting never sees)."""
    rows = runs
    for key, value in where.items():
        rows = rows[rows[key].astype(str) == str(value)]
    return {str(k): float(v) for k, v in rows.groupby("seed")["value"].mean().items()}


@dataclass(frozen=True)
class Cell:
    """One paired comparison of a claim: its name (`alpha 25%: p4 - fedavg`), the interval
    of the paired differences and its three-way verdict against `margin`."""

    name: str
    interval: Interval
    status: str
    reason: str
    margin: float = 0.0

    def text(self) -> str:
        return f"{self.name} {self.interval.text()}: {self.status}"


def cell(
    name: str,
    a: dict[str, float],
    b: dict[str, float],
    margin: float = 0.0,
    claimed: str = "above",
    within: bool = False,
) -> Cell:
    """a - b paired by seed; the claim: the difference lies `claimed` ("above" or
    "below") `margin`, or with `within`, |a - b| <= margin."""
    found = paired(a, b)
    status, reason = equivalent(found, margin) if within else decide(found, margin, claimed)
    return Cell(name, found, status, reason, margin)


def joined(name: str, cells: Sequence[Cell]) -> Cell:
    """One cell made of several that must all hold (a level against every rival): no if one
    is no, yes if all are yes, else inconclusive; shown by the cell that decided it."""
    statuses = [c.status for c in cells]
    status = "no" if "no" in statuses else "yes" if set(statuses) == {"yes"} else "inconclusive"
    worst = next(c for c in cells if c.status == status)
    return Cell(f"{name}: {worst.name}", worst.interval, status, worst.reason, worst.margin)


RULES = {"every": "yes only if every cell is yes", "most": "yes if more than half are yes"}


def from_cells(
    claim: str, cells: Sequence[Cell], rule: str = "every", note: str = "", limit: int = 6
) -> ClaimCheck:
    """A claim's verdict from its cells (`RULES`); the detail lists the cells (the ones not
    yes first when there are more than `limit`), the count and the seeds a verdict needs."""
    if not cells:
        return not_checked(claim, "no results to compare")
    count = {s: sum(c.status == s for c in cells) for s in ("yes", "no", "inconclusive")}
    if rule == "every":
        status = "no" if count["no"] else "yes" if count["yes"] == len(cells) else "inconclusive"
    else:
        status = (
            "yes"
            if 2 * count["yes"] > len(cells)
            else "no"
            if 2 * count["no"] >= len(cells)
            else "inconclusive"
        )
    shown = list(cells)
    if len(shown) > limit:
        shown = sorted(shown, key=lambda c: c.status == "yes")[:limit]
    parts = [c.text() for c in shown]
    if len(shown) < len(cells):
        parts.append(f"{len(cells) - len(shown)} more")
    if len(cells) > 1:
        parts.append(
            f"{count['yes']} yes, {count['no']} no, {count['inconclusive']} inconclusive "
            f"of {len(cells)} ({RULES[rule]})"
        )
    deciding = next(c for c in cells if c.status == status) if status in count else cells[0]
    needs = [c.interval.seeds_needed(c.margin) for c in cells if c.status == "inconclusive"]
    counts = [n for n in needs if n is not None]
    need = (
        max(counts) if status == "inconclusive" and counts and len(counts) == len(needs) else None
    )
    if len(cells) == 1:
        parts.append(deciding.reason)  # it says the seeds a verdict needs
    elif status == "inconclusive":
        parts += list(dict.fromkeys(c.reason for c in cells if not c.interval.bounded))
        if need is not None:
            parts.append(f"a decisive verdict needs about {need} seeds at the observed spread")
    return ClaimCheck(
        claim,
        status,
        "; ".join(parts + ([note] if note else [])),
        interval=deciding.interval,
        seeds_needed=need,
    )


def not_tested_on(claim: str, needs: str, ran: str, figures: str = "") -> ClaimCheck:
    """A claim the paper states for another dataset: not tested unless that dataset ran."""
    return ClaimCheck(
        claim,
        "not tested",
        f"needs {needs}; ran {ran}"
        + (f"; figures on {ran}, no verdict: {figures}" if figures else ""),
    )


# P4's claim checks moved beside its methods in 0.2 (a paper's claims are its plugin's)
__getattr__ = forward_moved(
    "p4bench.claims",
    {
        name: "p4bench_p4.claims"
        for name in (
            "ABLATIONS",
            "ATTACKS",
            "PAPER_TOLERANCE",
            "POINTS",
            "ablation_claims",
            "defense_claims",
            "heterogeneity_claims",
            "malicious_claims",
            "privacy_claims",
        )
    },
)
