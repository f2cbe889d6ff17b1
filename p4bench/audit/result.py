"""`AuditResult`: an audit's pooled trials, its bound and the claim it is compared with.

Below both `p4bench.audit.core` (which computes it) and `p4bench.audit.report` (which
plots and logs it).
"""

from __future__ import annotations

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
    # the method level's replay checks (`PostProcessingResult.as_dict()`): post-processing and
    # record isolation, behaviour the trials may be too few to show
    behaviour: dict[str, Any] | None = None

    @property
    def exceeds(self) -> bool:
        """The audit refutes the claim: the lower bound is above the claimed epsilon."""
        return self.bound.epsilon_lower > self.claimed_epsilon

    @property
    def leaks(self) -> bool:
        """The replay checks found records reaching what the method lets out outside its
        releases, or moving other records' terms inside them: no epsilon holds."""
        return self.behaviour is not None and self.behaviour.get("status") == "failed"

    @property
    def inconclusive(self) -> bool:
        """The claim cannot fail: even a perfect test on these trials stays below it."""
        return not self.exceeds and not self.leaks and self.bound.ceiling <= self.claimed_epsilon

    @property
    def verdict(self) -> str:
        """`exceeds`, `leaks`, `inconclusive` or `consistent`."""
        if self.exceeds:
            return "exceeds"
        return "leaks" if self.leaks else "inconclusive" if self.inconclusive else "consistent"

    def runs_needed(self) -> int | None:
        """Runs whose trials could show a bound above the claim (None: beyond 100,000)."""
        b = self.bound
        return runs_to_reach(self.claimed_epsilon, b.positives, b.negatives, b.delta, b.confidence, self.runs)

    @property
    def claim_label(self) -> str:
        return {True: "certified", False: "uncertified", None: "claimed"}[self.certified]

    def line(self) -> str:
        b = self.bound
        if self.exceeds:
            verdict = "EXCEEDS the claimed epsilon: the privacy claim does not hold"
        elif self.leaks:
            assert self.behaviour is not None
            findings = "; ".join(self.behaviour.get("findings") or [])
            verdict = f"LEAKS: the replay checks show records outside the ledger ({findings}): the privacy claim does not hold"
        elif self.inconclusive:
            needed = self.runs_needed()
            verdict = (f"inconclusive: ceiling {b.ceiling:.2f} below the claim (no bound from these trials can exceed "
                       f"it); " + (f"--runs {needed} would lift the ceiling above it" if needed else
                                   "more than 100,000 runs would be needed"))
        else:
            verdict = "consistent"
        runs = f"{self.runs} run" + ("s" if self.runs != 1 else "")
        canaries = f", {self.canaries_per_client} canaries per client" if self.level == "method" else ""
        took = f", {self.seconds:.1f} s" if self.seconds is not None else ""
        return (
            f"audit {self.config.method} on {self.config.dataset} ({self.scope}): empirical epsilon >= {b.epsilon_lower:.2f} "
            f"at {_percent(b.confidence)} confidence ({b.trials} trials in {runs}{canaries}, ceiling {b.ceiling:.2f}{took}) vs "
            f"{self.claim_label} epsilon {self.claimed_epsilon:.2f} ({self.accountant}, {self.neighbouring}): {verdict}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.config.method,
            "dataset": self.config.dataset,
            "epsilon_lower": self.bound.epsilon_lower,
            "claimed_epsilon": self.claimed_epsilon,
            "epsilon_certified": self.certified,
            "exceeds": self.exceeds,
            "verdict": self.verdict,
            "checked": self.scope,
            "level": self.level,
            "observer": self.observer,
            "canary_kind": "input records with probe twins" if self.level == "method" else "gradients after clipping",
            "seconds": self.seconds,
            "runs_needed": self.runs_needed() if self.inconclusive else None,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "runs": self.runs,
            "canaries_per_client": self.canaries_per_client,
            "seeds": [s["seed"] for s in self.summaries],
            "run_ids": [s.get("run_id") for s in self.summaries],
            "noise_multiplier": self.summaries[0].get("noise_multiplier"),
            **{k: v for k, v in self.bound.as_dict().items() if k != "epsilon_lower"},
            "notes": self.notes,
            "behaviour": self.behaviour,
            "plot": str(self.plot) if self.plot else None,
            "tracking_uri": self.summaries[-1].get("tracking_uri"),
            "tracking_error": self.tracking_error,
        }


def _percent(confidence: float) -> str:
    return f"{100 * confidence:.6g}%"
