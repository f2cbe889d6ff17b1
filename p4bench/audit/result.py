"""`AuditResult`: an audit's pooled trials, its bound and the claim it is compared with,
and the verdict in words: `refuted` (the lower bound exceeds the claim: the claim
fails), `leaks` (the method level's replays), `inconclusive` (the ceiling, the bound a
perfect separation of these canaries would give, is not above the claim: this audit
cannot refute it, however the run behaves) or `consistent` (it could have, and did not).

Below both `p4bench.audit.core` (which computes it) and `p4bench.audit.report` (which
plots and logs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from p4bench.audit.stats import AuditBound, runs_to_reach
from p4bench.config import RunConfig

__all__ = ["AuditResult", "SCOPE"]

# What this audit checks, said on every line: the DP mechanism alone. Its canaries are
# gradients inserted after clipping, at the claimed sampling rate, and observed in the noisy
# releases; the method's own sampling, clipping, teachers and messages are not checked.
SCOPE = "mechanism-level: gradient canaries after clipping, observed in the noisy releases"


@dataclass
class AuditResult:
    """The pooled trials, the bound, and the claim it is compared with."""

    config: RunConfig
    bound: AuditBound
    claimed_epsilon: float
    certified: bool | None  # None: the runs did not say
    accountant: str
    neighbouring: str
    runs: int
    canaries_per_client: int
    scores: np.ndarray  # (N,) every trial's score, runs pooled
    included: np.ndarray  # (N,) bool, the canaries' true bits
    summaries: list[dict[str, Any]]  # each run's summary
    notes: list[str] = field(default_factory=list)
    plot: Path | None = None
    tracking_error: str | None = None
    level: str = "mechanism"  # or "method" (`p4bench.audit.method_level`)
    observer: str | None = None  # the method level's view: messages | final
    scope: str = SCOPE  # what was checked, said on the line
    seconds: float | None = None  # wall time of the whole audit
    cpu_seconds: float | None = None  # CPU time of the whole audit (this process, every thread)
    # the method level's replay checks (`PostProcessingResult.as_dict()`): post-processing and
    # record isolation, behaviour the trials may be too few to show
    behaviour: dict[str, Any] | None = None

    @property
    def exceeds(self) -> bool:
        """The audit refutes the claim: the lower bound is above the claimed epsilon."""
        return self.bound.epsilon_lower > self.claimed_epsilon

    @property
    def refuted(self) -> bool:
        """`exceeds`: the claim fails."""
        return self.exceeds

    @property
    def leaks(self) -> bool:
        """The replay checks found records reaching what the method lets out outside its
        releases, or moving other records' terms inside them: no epsilon holds."""
        return self.behaviour is not None and self.behaviour.get("status") == "failed"

    @property
    def inconclusive(self) -> bool:
        """The claim cannot fail: even a perfect separation of these canaries stays below it."""
        return not self.exceeds and not self.leaks and self.bound.ceiling <= self.claimed_epsilon

    @property
    def separated(self) -> bool:
        """The canaries separated perfectly (one-run: every in-canary scored above every
        out-canary; multi-run: the test was perfect on the evaluation half): the bound is
        at its ceiling, as high as this many canaries can show."""
        b = self.bound
        return bool(b.separated) if b.separated is not None else b.at_ceiling

    @property
    def verdict(self) -> str:
        """`refuted`, `leaks`, `inconclusive` or `consistent`."""
        if self.exceeds:
            return "refuted"
        return "leaks" if self.leaks else "inconclusive" if self.inconclusive else "consistent"

    def runs_needed(self) -> int | None:
        """Runs whose canaries could show a bound above the claim (None: beyond 100,000 runs
        or, one-run, 2 million canaries)."""
        b = self.bound
        if b.bound == "one-run":
            from p4bench.audit.one_run import one_run_runs_to_reach

            return one_run_runs_to_reach(
                self.claimed_epsilon,
                b.trials,
                self.runs,
                b.delta,
                b.confidence,
                b.analysis or "fdp",
            )
        return runs_to_reach(
            self.claimed_epsilon, b.positives, b.negatives, b.delta, b.confidence, self.runs
        )

    @property
    def claim_label(self) -> str:
        return {True: "certified", False: "uncertified", None: "claimed"}[self.certified]

    def verdict_text(self) -> str:
        """The verdict in words, with what it rests on."""
        b = self.bound
        perfectly = "canaries separated perfectly (the bound is at its ceiling)"
        if self.exceeds:
            return (
                f"refuted: the lower bound {b.epsilon_lower:.2f} exceeds the claimed {self.claimed_epsilon:.2f}, so "
                f"the claim fails" + (f"; {perfectly}" if self.separated else "")
            )
        if self.leaks:
            assert self.behaviour is not None
            findings = "; ".join(self.behaviour.get("findings") or [])
            return (
                f"LEAKS: the replay checks show records outside the ledger ({findings}): "
                "the privacy claim does not hold"
            )
        if self.inconclusive:
            needed = self.runs_needed()
            lift = (
                f"--runs {needed} would lift the ceiling above the claim"
                if needed
                else "no number of runs up to 100,000 (or 2 million canaries) lifts the ceiling above the claim"
            )
            head = f"inconclusive, {perfectly}" if self.separated else "inconclusive"
            return f"{head}: this audit cannot refute a claim above {b.ceiling:.2f}; {lift}"
        return f"consistent: the lower bound {b.epsilon_lower:.2f} is below the claim"

    def line(self) -> str:
        b = self.bound
        runs = f"{self.runs} run" + ("s" if self.runs != 1 else "")
        canaries = (
            f", {self.canaries_per_client} canaries per client" if self.level == "method" else ""
        )
        if b.bound == "one-run":
            name = "one-run (Steinke et al.)" if b.analysis == "steinke" else "one-run (f-DP)"
            counts = f"{b.correct} of {b.guesses} guesses right on {b.trials} canaries in {runs}{canaries}"
        else:
            name, counts = "multi-run", f"{b.trials} trials in {runs}{canaries}"
        took = f", {self.seconds:.1f} s" if self.seconds is not None else ""
        took += f", {self.cpu_seconds:.1f} CPU s" if self.cpu_seconds is not None else ""
        return (
            f"audit {self.config.method} on {self.config.dataset} ({self.scope}): {name} empirical epsilon >= "
            f"{b.epsilon_lower:.2f} at {_percent(b.confidence)} confidence "
            f"({counts}; ceiling {b.ceiling:.2f}, the bound "
            f"of a perfect separation{took}) vs {self.claim_label} epsilon "
            f"{self.claimed_epsilon:.2f} ({self.accountant}, "
            f"{self.neighbouring}): {self.verdict_text()}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.config.method,
            "dataset": self.config.dataset,
            "epsilon_lower": self.bound.epsilon_lower,
            "claimed_epsilon": self.claimed_epsilon,
            "epsilon_certified": self.certified,
            "exceeds": self.exceeds,
            "refuted": self.exceeds,
            "verdict": self.verdict,
            "verdict_text": self.verdict_text(),
            "separated": self.separated,
            "checked": self.scope,
            "level": self.level,
            "observer": self.observer,
            "canary_kind": "input records with probe twins"
            if self.level == "method"
            else "gradients after clipping",
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "runs_needed": self.runs_needed() if self.inconclusive else None,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "runs": self.runs,
            "canaries_per_client": self.canaries_per_client,
            "seeds": [s["seed"] for s in self.summaries],
            "run_ids": [s.get("run_id") for s in self.summaries],
            "noise_multiplier": self.summaries[0].get("noise_multiplier"),
            # NaN (a figure the bound does not define) as null
            **{
                k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in self.bound.as_dict().items()
                if k != "epsilon_lower"
            },
            "guesses": self.bound.guesses,
            "notes": self.notes,
            "behaviour": self.behaviour,
            "plot": str(self.plot) if self.plot else None,
            "tracking_uri": self.summaries[-1].get("tracking_uri"),
            "tracking_error": self.tracking_error,
        }


def _percent(confidence: float) -> str:
    return f"{100 * confidence:.6g}%"
