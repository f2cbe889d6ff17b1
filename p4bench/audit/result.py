"""`AuditResult`: an audit's pooled trials, its bound and the claim it is compared with.

Below both `p4bench.audit.core` (which computes it) and `p4bench.audit.report` (which
plots and logs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from p4bench.audit.stats import AuditBound
from p4bench.config import RunConfig

__all__ = ["AuditResult"]


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

    @property
    def exceeds(self) -> bool:
        """The audit refutes the claim: the lower bound is above the claimed epsilon."""
        return self.bound.epsilon_lower > self.claimed_epsilon

    @property
    def claim_label(self) -> str:
        return {True: "certified", False: "uncertified", None: "claimed"}[self.certified]

    def line(self) -> str:
        b = self.bound
        verdict = "EXCEEDS the claimed epsilon: the privacy claim does not hold" if self.exceeds else "consistent"
        runs = f"{self.runs} run" + ("s" if self.runs != 1 else "")
        return (
            f"audit {self.config.method} on {self.config.dataset}: empirical epsilon >= {b.epsilon_lower:.2f} "
            f"at {_percent(b.confidence)} confidence ({b.trials} trials in {runs}) vs {self.claim_label} epsilon "
            f"{self.claimed_epsilon:.2f} ({self.accountant}, {self.neighbouring}): {verdict}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.config.method,
            "dataset": self.config.dataset,
            "epsilon_lower": self.bound.epsilon_lower,
            "claimed_epsilon": self.claimed_epsilon,
            "epsilon_certified": self.certified,
            "exceeds": self.exceeds,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "runs": self.runs,
            "canaries_per_client": self.canaries_per_client,
            "seeds": [s["seed"] for s in self.summaries],
            "run_ids": [s.get("run_id") for s in self.summaries],
            "noise_multiplier": self.summaries[0].get("noise_multiplier"),
            **{k: v for k, v in self.bound.as_dict().items() if k != "epsilon_lower"},
            "notes": self.notes,
            "plot": str(self.plot) if self.plot else None,
            "tracking_uri": self.summaries[-1].get("tracking_uri"),
            "tracking_error": self.tracking_error,
        }


def _percent(confidence: float) -> str:
    return f"{100 * confidence:.6g}%"
