"""Intervals over seeds: what a claim's verdict and `p4bench compare` rest on.

A claim compares two sides (P4 and a rival, an attacked run and its ideal-defense twin, ...)
whose runs share seeds: the runs of one seed are one pair (same partition, same setting), so
the seed-to-seed spread that both sides share cancels. The verdict rests on the paired
differences d_s = a_s - b_s over the seeds s both sides ran:

- `METHOD`: a two-sided 95% Student t interval, mean(d) +- t(0.975, n-1) * sd(d) / sqrt(n),
  sd the sample standard deviation (n-1). With n < 2 there is no interval.
- `decide`: three-way verdict against the claim's margin (0 unless the claim states one):
  `yes` when the whole interval lies on the claimed side beyond the margin, `no` when it
  lies wholly on the other side, `inconclusive` when it covers the margin or n < 2.
- `seeds_needed`: the seeds at which, at the observed spread sd(d), the interval's
  half-width would fall below the observed distance |mean(d) - margin|: how many seeds
  a decisive verdict needs (an estimate: the spread itself is estimated from few seeds).

`compare` shows the same interval for a group's mean (one sample, not paired) and draws no
error bar where n = 1.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "LEVEL",
    "METHOD",
    "MIN_SEEDS",
    "Interval",
    "decide",
    "equivalent",
    "half_width",
    "interval",
    "paired",
    "seeds_note",
    "t_quantile",
]

LEVEL = 0.95
MIN_SEEDS = 2  # the fewest seeds that give an interval (a verdict needs at least these)
METHOD = "95% Student t interval on the per-seed paired differences (n-1 degrees of freedom)"
MAX_SEEDS = 1000  # `seeds_needed` looks no further


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def half_width(sd: float, n: int, level: float = LEVEL) -> float:
    """Half-width of the t interval of a mean of n values with sample standard deviation
    `sd`; NaN when n < 2 (no interval from one value)."""
    if n < MIN_SEEDS or sd != sd:
        return math.nan
    return t_quantile(n - 1, level) * sd / math.sqrt(n)


@dataclass(frozen=True)
class Interval:
    """The mean of n values (paired differences, or one side's accuracies) with its 95% t
    interval; `low` and `high` are NaN when n < 2."""

    n: int
    mean: float
    sd: float = math.nan  # sample standard deviation (n-1); NaN when n < 2

    @property
    def half(self) -> float:
        return half_width(self.sd, self.n)

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    @property
    def bounded(self) -> bool:
        """Whether there is an interval (n >= 2)."""
        return self.n >= MIN_SEEDS and not math.isnan(self.half)

    def seeds_needed(self, margin: float = 0.0) -> int | None:
        """Seeds at which the half-width at this spread falls below |mean - margin|; None
        without a spread (n < 2) or when the mean sits on the margin (no count decides)."""
        distance = abs(self.mean - margin)
        if not self.bounded or distance == 0:
            return None
        if self.sd == 0:
            return MIN_SEEDS
        for n in range(MIN_SEEDS, MAX_SEEDS + 1):
            if half_width(self.sd, n) < distance:
                return n
        return None

    def text(self, scale: float = 100.0, unit: str = " points") -> str:
        """`+3.2 points [95% CI +1.0, +5.4], n=3`; one seed: `+3.2 points (n=1: no interval)`."""
        if self.n == 0:
            return "no paired seeds"
        value = f"{scale * self.mean:+.1f}{unit}"
        if not self.bounded:
            return f"{value} (n={self.n}: no interval)"
        return f"{value} [95% CI {scale * self.low:+.1f}, {scale * self.high:+.1f}], n={self.n}"


def interval(values: Iterable[float]) -> Interval:
    """The t interval of the mean of `values` (NaN values left out)."""
    kept = [float(v) for v in values if v == v]
    if not kept:
        return Interval(0, math.nan)
    mean = sum(kept) / len(kept)
    if len(kept) < MIN_SEEDS:
        return Interval(len(kept), mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
    return Interval(len(kept), mean, sd)


Key = TypeVar("Key", bound=Hashable)


def paired(a: Mapping[Key, float], b: Mapping[Key, float]) -> Interval:
    """The interval of a - b over the keys (seeds) both sides have."""
    return interval(a[k] - b[k] for k in a if k in b)


def decide(
    found: Interval, margin: float = 0.0, claimed: str = "above", scale: float = 100.0
) -> tuple[str, str]:
    """(status, reason) of "the difference lies `claimed` `margin`": "above" (strictly),
    "at-or-above" (a >= claim) or "below" (strictly). `yes` when the whole interval lies on
    the claimed side, `no` when it lies wholly on the other (an interval exactly at the margin
    refutes a strict claim), else `inconclusive`."""
    where = f"{scale * margin:+g} points" if margin else "0"
    if found.n == 0:
        return "inconclusive", "no seed ran on both sides"
    if not found.bounded:
        return (
            "inconclusive",
            f"n={found.n} seed: no interval (a verdict needs at least {MIN_SEEDS} seeds)",
        )
    low, high = found.low, found.high
    sides = {  # claimed: (holds, fails, its words, the other side's)
        "above": (low > margin, high <= margin, "above", "at or below"),
        "at-or-above": (low >= margin, high < margin, "at or above", "below"),
        "below": (high < margin, low >= margin, "below", "at or above"),
    }
    holds, fails, ours, theirs = sides[claimed]
    if holds:
        return "yes", f"the interval lies {ours} {where}"
    if fails:
        return "no", f"the interval lies {theirs} {where}"
    need = found.seeds_needed(margin)
    return "inconclusive", f"the interval covers {where}" + (
        f"; about {need} seeds at this spread would decide" if need else ""
    )


def equivalent(found: Interval, points: float, scale: float = 100.0) -> tuple[str, str]:
    """(status, reason) of "|difference| <= points": `yes` when the interval lies within
    [-points, +points], `no` when wholly outside, else `inconclusive`."""
    band = f"+-{scale * points:g} points"
    if not found.bounded:
        return decide(found)
    if -points <= found.low and found.high <= points:
        return "yes", f"the interval lies within {band}"
    if found.low > points or found.high < -points:
        return "no", f"the interval lies outside {band}"
    return "inconclusive", f"the interval crosses the edge of {band}"


def seeds_note(report: Any) -> str:
    """The line above a preset's claims (`p4bench.studies.reproduce.ReproduceReport`): the
    interval's method, the seeds that ran, and how many a decisive verdict needs (the
    inconclusive claims' own estimates)."""
    seeds = len({run.config.seed for run in report.sweep.planned})
    needs = [c.seeds_needed for c in report.claims if getattr(c, "seeds_needed", None)]
    text = (
        f"verdicts: {METHOD}, runs paired by seed and setting; {seeds} seed{'s' if seeds != 1 else ''} "
        f"ran; yes / no only where the interval clears the claim's margin, and an interval needs "
        f"at least {MIN_SEEDS} seeds"
    )
    if needs:
        text += f"; the inconclusive claims' observed spreads would need up to {max(needs)} seeds"
    return text
