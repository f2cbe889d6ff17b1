"""`run_audit`: train with canaries, score them, bound epsilon from below.

One training run gives clients x canaries per client canaries; `runs` repeats training
with seeds seed..seed+runs-1 (fresh canaries and bits each time) and pools them. The
bound (`bound`, `p4bench.audit.one_run.audit_bound`) is by default the one-run bound
(`p4bench.audit.one_run`), which needs no independence between canaries and, at the
default 20 clients x 650 canaries on digits, can refute a claim up to about 8.1 from
one run; "multi-run" keeps the hypothesis test of Jagielski et al. The claimed epsilon
is the run's own (ledger) figure; a lower bound above it means the privacy claim does
not hold for this mechanism.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pluggy

from p4bench.audit.canaries import AuditedMechanism, CanaryBank
from p4bench.audit.one_run import BOUNDS, audit_bound
from p4bench.audit.result import AuditResult  # re-exported: it was defined here
from p4bench.config import RunConfig
from p4bench.errors import IncompatibleError, UsageError
from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.privacy.ledger import PrivacyLedger
    from p4bench.privacy.mechanism import DPMechanism
    from p4bench.records import RoundReport, RunInfo
    from p4bench.run.runner import PreparedRun

__all__ = ["AuditResult", "audit_config", "check_audit_inputs", "finish_audit", "run_audit"]


def audit_config(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """The config the audit trains with, and notes on what it changed. Refuses
    non-private runs: there is no claim to audit."""
    if not config.private:
        raise UsageError("the audit needs a private run: give --epsilon or --noise-multiplier")
    notes = []
    if config.method == "p4" and config.options.get("fused") not in (False, "off"):
        config = config.replace(options={**config.options, "fused": False})
        notes.append(
            "p4 is audited with -o fused=false: its fused paths add noise outside DPMechanism.release, "
            "where canaries cannot be inserted (same releases, unfused)"
        )
    return config, notes


def check_audit_inputs(
    runs: int, canaries_per_client: int | None, confidence: float, bound: str = "one-run"
) -> None:
    """UsageError (exit 2) for runs < 1, canaries per client < 1, a confidence outside (0, 1)
    or an unknown bound."""
    if bound not in BOUNDS:
        raise UsageError(f"--bound must be one of {', '.join(BOUNDS)}, got '{bound}'")
    if runs < 1:
        raise UsageError(f"--runs must be >= 1, got {runs}")
    if canaries_per_client is not None and canaries_per_client < 1:
        raise UsageError(f"--canaries-per-client must be >= 1, got {canaries_per_client}")
    if not 0.0 < confidence < 1.0:
        raise UsageError(f"--confidence must be in (0, 1), got {confidence}")


def run_audit(
    config: RunConfig,
    *,
    runs: int = 1,
    canaries_per_client: int | None = None,
    confidence: float = 0.95,
    bound: str = "one-run",
    wrap_mechanism: Callable[[DPMechanism], DPMechanism] | None = None,
    observers: Sequence[object] = (),
    plugin_manager: pluggy.PluginManager | None = None,
    track: bool = True,
    plot: str | Path | None = None,
    on_run: Callable[[int, dict[str, Any]], None] | None = None,
) -> AuditResult:
    """Audit `config`'s method: `runs` trainings with canaries, then the bound (`bound`:
    one-run, steinke or multi-run; see `p4bench.audit.one_run.audit_bound`).

    `wrap_mechanism` replaces the run's DP mechanism before the audit wraps it (tests
    plant a faulty mechanism there). With `track` each run is an MLflow run, and the
    audit's figures, tags and plot are added to every one of them. `plot` (a PNG path)
    defaults to the last run's results folder when tracked, else no plot.
    """
    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.run.resolution import resolve_run_config
    from p4bench.run.runner import run

    started, cpu = time.perf_counter(), time.process_time()
    check_audit_inputs(runs, canaries_per_client, confidence, bound)
    plugin_manager = plugin_manager or create_plugin_manager()
    config, notes = audit_config(
        resolve_run_config(config, Registry(plugin_manager))
    )  # DP methods: their default epsilon
    scores, included, summaries, claims, deltas, sizes = [], [], [], [], [], []
    for index in range(runs):
        run_config = config.replace(seed=config.seed + index)
        state: dict[str, Any] = {}

        def on_prepared(
            prepared: PreparedRun, state: dict[str, Any] = state, seed: int = run_config.seed
        ) -> None:
            bank = CanaryBank(prepared.job.data.num_clients, canaries_per_client, seed)
            existing = prepared.job.wrap_mechanism

            def wrap(mechanism: DPMechanism) -> DPMechanism:
                if wrap_mechanism is not None:
                    mechanism = wrap_mechanism(mechanism)
                if existing is not None:
                    mechanism = existing(mechanism)
                return AuditedMechanism(mechanism, bank)

            prepared.job.wrap_mechanism = wrap
            state.update(bank=bank, ledger=prepared.ledger)

        early = (
            [*observers, _FirstRoundCheck(run_config.method, state)] if index == 0 else observers
        )
        result = run(
            run_config,
            observers=early,
            plugin_manager=plugin_manager,
            track=track,
            on_prepared=on_prepared,
        )
        bank, ledger = state["bank"], state["ledger"]
        _check_observed(run_config.method, bank, ledger)
        claimed = float(result.summary["epsilon"])
        # every client whose own epsilon is within the claim (the reported ones at least)
        epsilons = ledger.epsilons()
        chosen = (bank.releases.numpy() > 0) & (epsilons <= claimed * (1 + 1e-9) + 1e-12)
        scores.append(bank.scores.numpy()[chosen].reshape(-1))
        included.append(bank.included.numpy()[chosen].reshape(-1))
        summaries.append(result.summary.as_dict())
        claims.append(claimed)
        deltas.append(float(result.summary["delta"]))
        sizes.append(bank.per_client)
        if on_run is not None:
            on_run(index, result.summary.as_dict())

    all_scores, all_included = np.concatenate(scores), np.concatenate(included)
    figures = audit_bound(
        all_scores,
        all_included,
        delta=max(deltas),
        confidence=confidence,
        bound=bound,
        seed=config.seed,
    )
    certified_flags = [s.get("epsilon_certified") for s in summaries]
    certified = (
        None if any(f is None for f in certified_flags) else all(bool(f) for f in certified_flags)
    )
    last = summaries[-1]
    audit = AuditResult(
        config=config,
        bound=figures,
        claimed_epsilon=max(claims),
        certified=certified,
        accountant=str(last.get("accountant")),
        neighbouring=str(last.get("neighbouring")),
        runs=runs,
        canaries_per_client=max(sizes),
        scores=all_scores,
        included=all_included,
        summaries=summaries,
        notes=notes,
    )
    return finish_audit(audit, last, track=track, plot=plot, started=started, cpu=cpu)


def finish_audit(
    audit: AuditResult,
    last: dict[str, Any],
    *,
    track: bool,
    plot: str | Path | None,
    started: float,
    cpu: float | None = None,
) -> AuditResult:
    """The audit's plot (`plot`, else the last run's results folder when tracked), its
    wall and CPU time (from `started`, `cpu`: `time.perf_counter()` and
    `time.process_time()` at its start), and its MLflow figures when tracked."""
    from p4bench.audit.report import log_audit, plot_scores

    folder = last.get("results_dir") if track else None
    target = (
        Path(plot) if plot is not None else (Path(folder) / "audit_scores.png" if folder else None)
    )
    if target is not None:
        audit.plot = plot_scores(audit, target)
    audit.seconds = time.perf_counter() - started
    if cpu is not None:
        audit.cpu_seconds = time.process_time() - cpu
    if track:
        audit.tracking_error = log_audit(audit)
    return audit


class _FirstRoundCheck:
    """After the first run's first round: refuse now, not after the whole run, when a
    release so far went around the canaries (a method that releases outside
    `DPMechanism.release` would train for minutes to be refused at the end)."""

    def __init__(self, method: str, state: dict[str, Any]) -> None:
        self.method, self.state = method, state

    @hookimpl
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        if report.step == 1 and self.state.get("bank") is not None:
            _check_observed(self.method, self.state["bank"], self.state["ledger"], final=False)


def _check_observed(
    method: str, bank: CanaryBank, ledger: PrivacyLedger, final: bool = True
) -> None:
    """Refuse when the ledger counted releases the canaries never went through (and, at
    the end of a run, when there were none at all)."""
    counted = np.zeros(bank.num_clients, dtype=np.int64)
    for key in ledger.keys:
        counted += ledger.steps[key]
    observed = bank.releases.numpy()
    missing = int(np.clip(counted - observed, 0, None).sum())
    if not final and not bank.bypassed and not missing:
        return
    if bank.bypassed or missing or not observed.any():
        how = f" (calls to {', '.join(bank.bypassed)})" if bank.bypassed else ""
        raise IncompatibleError(
            f"method '{method}' made {missing} of {int(counted.sum())} ledger releases "
            f"outside DPMechanism.release{how}, "
            f"so the audit could not insert or observe its canaries there; no bound would be meaningful"
        )
    assert bank.scores is not None  # drawn at the first observed release
    if math.isnan(float(bank.scores.sum())):
        raise IncompatibleError(
            f"method '{method}': canary scores are not finite (the mechanism reported zero noise?)"
        )
