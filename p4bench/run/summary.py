"""A finished run's headline figures (the summary) and the per-round detection score.

Counts are those the user asked for: `rounds` and `rounds_completed` are the rounds of
the method's last phase (the configured `--rounds` for every built-in method); a phase
before it (P4's grouping, SCAFFOLD's warm-up) is reported on its own in `phases`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from p4bench.records import (
    GLOBAL_ACCURACY,
    Outcome,
    PrivacyFigures,
    RoundReport,
    RunInfo,
    RunSummary,
    extra_metric_name,
)

__all__ = [
    "DetectionScore",
    "reported_mean",
    "spread",
    "summarize",
    "privacy_figures",
    "budget_fields",
    "within_budget",
    "summed_metrics",
    "early_stop_epsilon_note",
    "phase_rounds",
]


def reported_mean(accuracy: np.ndarray, reported: np.ndarray) -> float:
    """Mean of the reported clients' values (NaN when none is reported)."""
    return float(accuracy[reported].mean()) if reported.any() else float("nan")


def spread(values: np.ndarray) -> tuple[float, float]:
    """(std, p10) of clients' accuracies: the population standard deviation (ddof 0) and
    the bottom decile, the 10th percentile by numpy's default `linear` method (the value at
    rank 0.1 (n - 1) of the sorted values, interpolated); NaN for no value or a NaN one."""
    if len(values) == 0 or np.isnan(values).any():
        return float("nan"), float("nan")
    return float(np.std(values)), float(np.percentile(values, 10, method="linear"))


def phase_rounds(info: RunInfo) -> tuple[int, dict[str, int]]:
    """(rounds of the last phase, {phase: rounds} of every phase)."""
    phases = {p.name: int(p.rounds) for p in info.phases}
    return (int(info.phases[-1].rounds) if info.phases else 0), phases


class DetectionScore:
    """Per-round detection quality of a filtering defense, from the Aggregator's log of
    kept and dropped senders; only the harness knows who is malicious.

    precision = dropped malicious / dropped, recall = dropped malicious / malicious
    updates received, benign_dropped = dropped benign / benign updates received; a figure
    whose denominator is zero in a round is NaN (and not logged). The `_total` figures
    cover every aggregation so far. No defense drops every update of an aggregation, so
    where all senders are malicious (P4's similarity grouping puts label flippers
    together) their updates count as missed, even for the ideal defense.
    """

    def __init__(self, malicious: np.ndarray) -> None:
        self.malicious = malicious
        self.seen = 0  # log entries already scored
        self.totals = np.zeros(4, dtype=np.int64)  # true pos, false pos, false neg, true neg

    def score(self, log: list[tuple[int, list[int], list[int]]]) -> dict[str, float]:
        counts = np.zeros(4, dtype=np.int64)
        for _, kept, dropped in log[self.seen :]:
            bad_dropped = sum(1 for s in dropped if s >= 0 and self.malicious[s])
            bad_kept = sum(1 for s in kept if s >= 0 and self.malicious[s])
            counts += (bad_dropped, len(dropped) - bad_dropped, bad_kept, len(kept) - bad_kept)
        self.seen = len(log)
        self.totals += counts
        return {**_detection(counts, ""), **_detection(self.totals, "_total")}


def _detection(counts: np.ndarray, suffix: str) -> dict[str, float]:
    tp, fp, fn, tn = (int(c) for c in counts)
    return {
        f"detection_precision{suffix}": _ratio(tp, tp + fp),
        f"detection_recall{suffix}": _ratio(tp, tp + fn),
        f"detection_benign_dropped{suffix}": _ratio(fp, fp + tn),
    }


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


def summarize(
    info: RunInfo,
    outcome: Outcome,
    wall_time_s: float,
    *,
    method_figures: dict[str, float] | None = None,
    rejections: dict[str, int] | None = None,
    privacy: Mapping[str, Any] | None = None,
    privacy_context: dict[str, Any] | None = None,
    verification: dict[str, Any] | None = None,
    compute_device: str = "cpu",
    memory: dict[str, object] | None = None,
    resumed_from_step: int | None = None,
    unseen: dict[str, Any] | None = None,
    threads: int | None = None,
) -> RunSummary:
    """The run's headline figures (summary.json, the JSON line of `p4bench run --json`), each
    field written here once: the accuracy, rounds and costs from the run's info and outcome,
    the sections from their owners (`privacy`: the ledger's `summary`, None when the run is
    not private; the certification: `info.certification`; `unseen`: the unseen clients'
    figures, `p4bench.run.unseen.UnseenClients.summary`; `threads`: the torch threads it
    computed on)."""
    config, reported = info.config, info.reported
    accuracy = outcome.accuracy
    chosen = accuracy[reported] if reported.any() else np.array([float("nan")])
    budget = budget_fields(info, outcome)
    global_accuracy = outcome.extra_accuracy.get(GLOBAL_ACCURACY)
    evaluation = eval_fields(config.eval_set, chosen, global_accuracy, reported)
    rejected = rejections or {}
    std, p10 = spread(chosen)
    return RunSummary(
        run_id=info.run_id,
        method=config.method,
        attack=config.attack,
        defense=info.defense,
        dataset=config.dataset,
        partitioner=config.partitioner,
        seed=config.seed,
        rounds=budget["rounds"],
        rounds_completed=budget["rounds_completed"],
        phases=budget["phases"],
        time_budget_min=budget["time_budget_min"],
        stopped_by_time_budget=budget["stopped_by_time_budget"],
        stopped_by_method=budget["stopped_by_method"],
        rounds_past_budget=budget.get("rounds_past_budget"),
        rounds_within_budget=budget.get("rounds_within_budget"),
        clients=config.clients,
        reported_clients=int(reported.sum()),
        evaluation_clients=int(np.asarray(info.evaluation).sum()),
        accuracy_mean=float(chosen.mean()),
        accuracy_min=float(chosen.min()),
        accuracy_max=float(chosen.max()),
        accuracy_std=std,
        accuracy_p10=p10,
        accuracy_per_client={str(i): float(accuracy[i]) for i in np.flatnonzero(reported)},
        extra_accuracy={
            extra_metric_name(name): reported_mean(values, reported)
            for name, values in outcome.extra_accuracy.items()
        },
        eval_set=evaluation["eval_set"],
        accuracy=evaluation["accuracy"],
        accuracy_global_min=evaluation.get("accuracy_global_min"),
        accuracy_global_max=evaluation.get("accuracy_global_max"),
        accuracy_global_std=evaluation.get("accuracy_global_std"),
        accuracy_global_p10=evaluation.get("accuracy_global_p10"),
        unseen=unseen or {},
        bytes_sent=int(outcome.bytes_sent),
        bytes_per_phase=_per_phase(outcome.reports, lambda r: r.bytes_sent),
        seconds_per_phase={
            k: round(v, 4) for k, v in _per_phase(outcome.reports, lambda r: r.seconds).items()
        },
        client_bytes_sent=_client_total(outcome.reports, "client_bytes_sent"),
        client_bytes_received=_client_total(outcome.reports, "client_bytes_received"),
        wall_time_s=round(wall_time_s, 4),
        config_hash=info.config_hash or config.config_hash(),
        plugins=info.plugins,
        public_data=info.public_data,  # unlabeled public data the method read (threat model)
        partition_stats=dict(info.partition_report.stats) or None,
        method_figures=method_figures or {},
        rejections=rejected,
        rejected_messages=sum(rejected.values()),
        privacy=None if privacy is None else privacy_figures(privacy, budget),
        privacy_context=privacy_context or {},
        certification=info.certification,
        verification=verification or {},
        compute_device=compute_device,
        memory=memory or {},
        resumed_from_step=resumed_from_step,
        threads=threads,
    )


def privacy_figures(ledger: Mapping[str, Any], budget: Mapping[str, Any]) -> PrivacyFigures:
    """The ledger's figures (`PrivacyLedger.summary`) as the summary's privacy section; with
    `epsilon_scope` where the time budget stopped the run (`budget`: `budget_fields`)."""
    scope = (
        early_stop_epsilon_note({**budget, "epsilon_budget": ledger["epsilon_budget"]})
        if budget["stopped_by_time_budget"]
        else None
    )
    return PrivacyFigures(
        epsilon=ledger["epsilon"],
        epsilon_mean=ledger["epsilon_mean"],
        epsilon_rdp=ledger["epsilon_rdp"],
        epsilon_rdp_mean=ledger["epsilon_rdp_mean"],
        epsilon_pld=ledger.get("epsilon_pld"),
        epsilon_pld_mean=ledger.get("epsilon_pld_mean"),
        epsilon_evaluation_clients=ledger["epsilon_evaluation_clients"],
        evaluation_clients=ledger.get("evaluation_clients"),
        epsilon_budget=ledger["epsilon_budget"],
        accountant=ledger["accountant"],
        delta=ledger["delta"],
        noise_multiplier=ledger["noise_multiplier"],
        clip=ledger["clip"],
        neighbouring=ledger["neighbouring"],
        clients_stopped=ledger["clients_stopped"],
        budget_stops=ledger["budget_stops"],
        epsilon_scope=scope,
    )


def eval_fields(
    eval_set: str, personal: np.ndarray, global_accuracy: np.ndarray | None, reported: np.ndarray
) -> dict[str, Any]:
    """Where accuracy was measured (`--eval`), and the headline `accuracy`: the mean over the
    reported clients on the global test set (`eval_set` global) or on their own test
    splits; with a global test set, its min, max, std and p10 over clients beside the mean."""
    fields: dict[str, Any] = {"eval_set": eval_set, "accuracy": float(personal.mean())}
    if global_accuracy is not None:
        chosen = global_accuracy[reported] if reported.any() else np.array([float("nan")])
        std, p10 = spread(chosen)
        fields.update(
            accuracy_global_min=float(chosen.min()),
            accuracy_global_max=float(chosen.max()),
            accuracy_global_std=std,
            accuracy_global_p10=p10,
        )
        if eval_set == "global":
            fields["accuracy"] = float(chosen.mean())
    return fields


def within_budget(outcome: Outcome) -> Outcome:
    """The outcome as the papers count a time budget: only rounds that finished within it.
    Where a round ended past the budget (`budget_overran_at`, its step), the accuracies are
    those the last round before it reported (every round evaluates the deployed models);
    the rounds past it stay in `reports` (they ran, sent bytes and spent privacy) and
    `budget_fields` counts them apart. A run whose first round overran keeps that round's
    figures: no round finished within the budget (summary `rounds_within_budget` 0)."""
    if outcome.budget_overran_at is None:
        return outcome
    kept = max(outcome.budget_overran_at - 1, 1)
    last = next((r for r in reversed(outcome.reports) if r.round >= 0 and r.step == kept), None)
    if last is None:
        return outcome
    return dataclasses.replace(
        outcome,
        accuracy=last.accuracy.copy(),
        extra_accuracy={name: values.copy() for name, values in last.extra_accuracy.items()},
    )


def budget_fields(info: RunInfo, outcome: Outcome) -> dict[str, Any]:
    """Rounds planned and run, per phase too, and whether the time budget
    (`time_budget_min`) cut the run short; the figures of such a run are those of the last
    round that finished within the budget (`within_budget`): `rounds_completed` counts the
    rounds that finished within it, `rounds_past_budget` those that ran past it."""
    rounds, phases = phase_rounds(info)
    overran = outcome.budget_overran_at
    done = {name: 0 for name in phases}
    past = 0
    for report in outcome.reports:
        if report.round < 0:
            continue
        if overran is not None and report.step >= max(
            overran, 2
        ):  # a first round that overran is kept
            past += 1
        else:
            done[report.phase] = done.get(report.phase, 0) + 1
    last = info.phases[-1].name if info.phases else ""
    budget = info.config.time_budget_min
    stopped = sum(done.values()) < info.total_rounds
    fields = {
        "rounds": rounds,
        "rounds_completed": done.get(last, 0),
        "phases": {
            name: {"rounds": planned, "completed": done.get(name, 0)}
            for name, planned in phases.items()
        },
        "time_budget_min": budget,
        "stopped_by_time_budget": overran is not None,
        # the method's own stopping rule (`Method.finished`, e.g. P4L's mrt/mrr) ended it
        "stopped_by_method": stopped and overran is None,
    }
    if overran is not None:
        fields.update(
            rounds_past_budget=past, rounds_within_budget=overran - 1
        )  # 0: even the first round overran
    return fields


def summed_metrics(reports: list[RoundReport]) -> dict[str, float]:
    """Every round metric summed over the run (what `Method.derived_metrics` reads)."""
    totals: dict[str, float] = {}
    for report in reports:
        for key, value in report.metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def early_stop_epsilon_note(summary: Mapping[str, Any]) -> str:
    """What the epsilon of a run stopped by its time budget covers: the ledger counts the
    releases actually taken, those of the rounds past the budget too (they ran), so it is
    not the planned one (sigma was calibrated for every round, so it is at most the target)."""
    target = summary.get("epsilon_budget")
    planned = f"; sigma was calibrated for all {summary['rounds']} rounds" + (
        f" at target epsilon {target:g}" if isinstance(target, (int, float)) else ""
    )
    past = int(summary.get("rounds_past_budget") or 0)
    beyond = f" and the {past} that ran past it" if past else ""
    return (
        f"releases taken in the {summary['rounds_completed']} of {summary['rounds']} rounds completed before the "
        f"time budget ({summary['time_budget_min']:g} min){beyond}{planned}"
    )


def _per_phase(reports: list[RoundReport], value: Callable[[RoundReport], Any]) -> dict[str, Any]:
    totals: dict[str, Any] = {}
    for report in reports:
        totals[report.phase] = totals.get(report.phase, 0) + value(report)
    return totals


def _client_total(reports: list[RoundReport], field_name: str) -> dict[str, float]:
    """Mean and max over clients of the bytes each sent (or received) in the whole run."""
    arrays = [getattr(r, field_name) for r in reports if getattr(r, field_name) is not None]
    if not arrays:
        return {"mean": 0.0, "max": 0.0}
    total = np.sum(arrays, axis=0)
    return {"mean": float(total.mean()), "max": float(total.max())}
