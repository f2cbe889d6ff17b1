"""Whether a run's epsilon holds: the privacy boundary of DESIGN.md, checked per run.

The accountants are exact for the releases they are told about. A run's epsilon is
*certified* only when every step that touches a client's records is either a ledger
release (the DP mechanism) or post-processing of releases and public values, and when
the mechanism's randomness is secret from whoever receives the releases. Otherwise the
run still reports the accountant's figure, but as *uncertified*, with the reasons:

- the method declares a data-dependent step outside the ledger
  (`Method.uncertified_steps`, e.g. P4/ProxyFL distilling the DP proxy from the non-DP
  private model);
- preprocessing computed from a client's records outside the ledger (ScatterNet
  features normalised with each client's own statistics);
- seeded DP randomness where the clients are separate parties (devices): every peer
  holds the seed, so it can recompute a neighbour's noise and batches;
- an accountant used outside what it is proved for (`accountant_reasons`): a sampling
  scheme other than the run's Poisson batches (Noble et al.'s bound is stated for
  batches of fixed size), or noble's third-party view for a method whose receivers see
  individual updates. The tight pld figure is reported beside it;
- the method's messages are not post-processing of its releases: the post-processing
  check (`p4bench.privacy.run_verification`, on the run itself by default) replayed it
  with other records and forced releases, and a message changed (or the check could not
  force its releases); or its record-isolation replay found a record moving other
  records' clipped terms inside a release;
- the check did not run at the run's size: it was switched off (`--verify off`), or
  made on a 4-client, 2-round stand-in (`--verify stand-in`), which is evidence about
  the stand-in, not the run.

Non-private runs carry no epsilon; they are reported as such, never as certified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Certification",
    "certify",
    "accountant_reasons",
    "NOT_VERIFIED",
    "RANDOMNESS_LABELS",
    "STAND_IN",
]

NOT_VERIFIED = "not verified"
STAND_IN = "verified on a 4-client, 2-round stand-in"

RANDOMNESS_LABELS = {
    "seeded": "seeded (reproducible, not secret)",
    "secure": "secret (per-client AES-CTR generator keyed from the OS CSPRNG)",
}


@dataclass(frozen=True)
class Certification:
    """The verdict on a run's privacy claim.

    Attributes:
        private: the run trains through the DP mechanism.
        certified: its epsilon holds (False for non-private runs: there is no claim).
        reasons: why not, one line each (empty when certified).
        randomness: ``"seeded"`` or ``"secret"``, the DP noise and batch selection source.
        post_processing: the method's post-processing check (`p4bench.privacy.post_processing`):
            "verified" (at the run's size), the `STAND_IN` wording, "failed", "not verifiable",
            "not verified" (switched off) or "not yet verified" (not run yet).
        isolation: that check's record-isolation replay (`p4bench.privacy.isolation`):
            "verified", "failed", "not checked" (batch clipping) or "not run".
    """

    private: bool
    certified: bool
    reasons: tuple[str, ...]
    randomness: str
    post_processing: str = "not yet verified"  # until the runner's check says otherwise
    isolation: str = "not run"

    @property
    def reason(self) -> str | None:
        """The reasons joined in one line, or None."""
        return "; ".join(self.reasons) if self.reasons else None

    def with_reasons(self, reasons: list[str]) -> Certification:
        """This verdict with more reasons (uncertified if there are any)."""
        if not reasons:
            return self
        return Certification(
            self.private,
            False,
            (*self.reasons, *reasons),
            self.randomness,
            self.post_processing,
            self.isolation,
        )

    def with_post_processing(self, verdict: dict[str, Any] | None) -> Certification:
        """This verdict with the method's post-processing check (`PostProcessingResult.as_dict()`;
        None: not run, so not certified). A check that failed or could not be made adds its
        reason; so does one made on a stand-in (a smaller federation than the run's)."""
        if not self.private:
            return self
        if verdict is None:
            updated = self.with_reasons(
                [
                    "not verified: the post-processing check was off (--verify off or P4BENCH_VERIFY=0), and an "
                    "epsilon is certified only where the run's messages were checked to be "
                    "post-processing of its releases"
                ]
            )
            return Certification(
                updated.private,
                updated.certified,
                updated.reasons,
                updated.randomness,
                NOT_VERIFIED,
                "not run",
            )
        status = str(verdict["status"])
        reasons = (
            []
            if status == "verified"
            else [
                f"post-processing check {status} for method '{verdict['method']}': {'; '.join(verdict['findings'])}"
            ]
        )
        if status == "verified" and verdict.get("scope", "stand-in") == "stand-in":
            status = STAND_IN
            reasons.append(
                f"{STAND_IN}, not at this run's size (--verify stand-in); --verify full checks the run itself"
            )
        updated = self.with_reasons(reasons)
        return Certification(
            updated.private,
            updated.certified,
            updated.reasons,
            updated.randomness,
            status,
            str(verdict.get("isolation", "not run")),
        )

    def summary_fields(self) -> dict[str, Any]:
        """The keys every run summary (and `--json` line) carries."""
        return {
            "private": self.private,
            "epsilon_certified": self.certified,
            "uncertified_reason": self.reason,
            "dp_randomness": self.randomness,
            **(
                {"post_processing": self.post_processing, "record_isolation": self.isolation}
                if self.private
                else {}
            ),
        }

    def tags(self) -> dict[str, str]:
        """MLflow tags: `dp.private`, `dp.certified`, `dp.randomness`, `dp.uncertified_reason`."""
        tags = {
            "dp.private": str(self.private).lower(),
            "dp.certified": str(self.certified).lower(),
            "dp.randomness": self.randomness,
        }
        if self.private:
            tags["dp.post_processing"] = self.post_processing
        if self.reason:
            tags["dp.uncertified_reason"] = self.reason
        return tags


# How private runs sample their batches (p4bench.engine.training.poisson_batches).
RUN_SAMPLING = "poisson"


def accountant_reasons(config: Any, accountant: Any, capabilities: Any) -> list[str]:
    """Why `accountant` (its class) does not certify this run: the run's sampling scheme
    is not one the analysis is proved for, or (noble) the third-party view is taken for a
    method whose receivers see individual updates. Empty where it applies."""
    reasons = []
    name = getattr(accountant, "name", config.accountant)
    proved = tuple(getattr(accountant, "sampling", (RUN_SAMPLING,)))
    if RUN_SAMPLING not in proved:
        reasons.append(
            f"accountant {name} is proved for {' or '.join(proved)} batches; this run samples {RUN_SAMPLING} batches, "
            "so its figure does not bound the run (the pld epsilon beside it is the tight one)"
        )
    view = str((config.options or {}).get("noble_view", "aggregator"))
    if (
        name == "noble"
        and view == "third-party"
        and getattr(capabilities, "shares_individual_updates", False)
    ):
        reasons.append(
            f"noble_view=third-party counts only an aggregate of many clients' noisy updates, but method "
            f"'{config.method}' sends individual updates: its aggregator or neighbours see one client's noise alone"
        )
    return reasons


def certify(
    config: Any,
    method_reasons: list[str],
    separate_parties: bool,
    accountant: Any = None,
    capabilities: Any = None,
) -> Certification:
    """The certification of a run whose config is resolved (`runner.resolve_run_config`).

    `method_reasons` are the method's own `uncertified_steps()`; `separate_parties` says
    whether the runtime's clients are separate parties (devices); `accountant` is the
    run's accountant class and `capabilities` the method's (`accountant_reasons`).
    """
    randomness = "secret" if config.noise_source == "secure" else "seeded"
    if not config.private:
        return Certification(False, False, ("non-private run: no DP, no epsilon",), randomness)
    reasons = list(method_reasons)
    if config.features == "scatter" and config.feature_norm == "client":
        reasons.append(
            "feature_norm=client: ScatterNet features normalised with each client's own training statistics "
            "outside the ledger (every record's input depends on every other record)"
        )
    if separate_parties and randomness == "seeded":
        reasons.append(
            "device simulation with seeded DP randomness: every peer holds the seed and can recompute "
            "a neighbour's noise and batches"
        )
    if accountant is not None:
        reasons += accountant_reasons(config, accountant, capabilities)
    return Certification(True, not reasons, tuple(reasons), randomness)
