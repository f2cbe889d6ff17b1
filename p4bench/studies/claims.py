"""What a preset's claim checks share (`p4bench reproduce`): each check turns a preset's
aggregated table (group keys, mean, std, n; key values as text) into yes / no / not checked
lines with the figures behind them. The checks themselves live beside each paper's methods
(`p4bench_p4.claims`, the karras, pdsl and p4l presets) and a third-party preset
uses these helpers the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p4bench.moved import forward_moved

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ClaimCheck", "ClaimContext", "means", "not_checked", "pct", "verdict"]


@dataclass(frozen=True)
class ClaimCheck:
    claim: str
    status: str  # yes | no | not checked | not tested (a quick smoke run: figures, no verdict)
    detail: str = ""
    training: bool = True  # False: computed without training runs, so a quick run's verdict stands


@dataclass(frozen=True)
class ClaimContext:
    dataset: str
    quick: bool
    skipped: tuple[str, ...]  # "kind 'name'" of unregistered plugins


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
