"""Running the coordinate search of `p4bench.studies.tune_axes` after lr is tuned: one
sweep of tuning runs per stage (an axis, or one widening step), every tuning group of the
stage at once, then one merged `TuneResult` for the report."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p4bench.studies.sweep import PlannedRun, SweepReport
from p4bench.studies.tune_axes import (
    WIDEN_STEPS,
    AxisOutcome,
    at_bound,
    axes_for,
    config_value,
    edge_of,
    edge_step,
)

__all__ = ["StagedTuning", "StageRunner", "tune_axes_staged"]

# (group name -> points to run, stage label) -> group name -> [(values, mean score)]
StageRunner = Callable[
    [Mapping[str, list[dict[str, Any]]], str], dict[str, list[tuple[dict[str, Any], float]]]
]


@dataclass
class StagedTuning:
    """Every group's chosen values (lr included), the outcome of every axis, and the runs
    each group spent."""

    chosen: dict[str, dict[str, Any]]
    outcomes: list[AxisOutcome] = field(default_factory=list)
    spent: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [outcome.line() for outcome in self.outcomes]

    def edges(self) -> list[AxisOutcome]:
        return [o for o in self.outcomes if o.edge]


def _key(values: Mapping[str, Any]) -> str:
    return json.dumps({k: values[k] for k in sorted(values)}, default=str)


def tune_axes_staged(
    groups: Sequence[Any],
    lr_scores: Mapping[str, Mapping[float, float]],
    lrs: Mapping[str, float],
    axes: Mapping[str, Sequence[Any]],
    tuning_options: Callable[[str], Sequence[str] | None],
    budget: int,
    run_stage: StageRunner,
    fixed: Sequence[str] = (),
) -> StagedTuning:
    """Widen lr's grid where its winner is on an edge, then tune every axis in order
    (`p4bench.studies.tune_axes`). `groups`: the tuning groups (`TuningGroup`); `lr_scores`:
    group -> lr -> mean score of the lr stage; `tuning_options(method)`: the run options the
    method's training reads (None: all); `fixed`: options the user set (never tuned)."""
    live = [g for g in groups if g.name in lrs]
    chosen = {g.name: {"lr": float(lrs[g.name])} for g in live}
    scores = {
        g.name: {_key({"lr": lr}): s for lr, s in lr_scores.get(g.name, {}).items()} for g in live
    }
    spent = {g.name: len(lr_scores.get(g.name, {})) for g in live}
    staged = StagedTuning(chosen, [], spent)

    def settle(axis: str, outcomes: dict[str, AxisOutcome]) -> None:
        """Widen `axis` beyond its winner's edge while the budget lasts."""
        for step in range(WIDEN_STEPS + 1):
            extra: dict[str, list[dict[str, Any]]] = {}
            for name, outcome in outcomes.items():
                winner = chosen[name][axis]
                edge = edge_of(list(outcome.scores), winner)
                outcome.edge = None if edge is None or at_bound(axis, winner) else edge
                nxt = edge_step(axis, list(outcome.scores), winner) if outcome.edge else None
                if nxt is None or step == WIDEN_STEPS:
                    continue
                if spent[name] + 1 > budget:
                    continue
                extra[name] = [{**chosen[name], axis: nxt}]
            if not extra:
                return
            _stage(extra, f"{axis} widened", axis, outcomes, widening=True)

    def _stage(
        points: dict[str, list[dict[str, Any]]],
        label: str,
        axis: str,
        outcomes: dict[str, AxisOutcome],
        widening: bool = False,
    ) -> None:
        found = run_stage(points, label)
        for name, tried in points.items():
            spent[name] += len(tried)
        for name, pairs in found.items():
            outcome = outcomes[name]
            outcome.widened += widening
            for values, score in pairs:
                scores[name][_key(values)] = score
                outcome.scores[values[axis]] = score
            best = chosen[name][axis]
            for value, score in outcome.scores.items():  # ties keep the incumbent
                if not math.isnan(score) and score > outcome.scores.get(best, -math.inf):
                    best = value
            chosen[name][axis] = outcome.chosen = best

    lr_outcomes = {}
    for name in chosen:
        outcome = AxisOutcome(name, "lr", dict(lr_scores.get(name, {})), chosen[name]["lr"])
        lr_outcomes[name] = outcome
    settle("lr", lr_outcomes)
    staged.outcomes.extend(lr_outcomes.values())
    for axis in axes:
        if axis in fixed:
            continue
        outcomes: dict[str, AxisOutcome] = {}
        points: dict[str, list[dict[str, Any]]] = {}
        for group in live:
            name = group.name
            own = axes_for(
                group.run.config, {axis: axes[axis]}, tuning_options(group.run.config.method)
            )
            if axis not in own:
                continue
            incumbent = config_value(group.run.config, axis)
            best_so_far = scores[name].get(_key(chosen[name]), math.nan)
            outcome = AxisOutcome(name, axis, {incumbent: best_so_far}, incumbent)
            new = [v for v in own[axis] if v != incumbent]
            if spent[name] + len(new) > budget:
                outcome.skipped = (
                    f"budget: {len(new)} more runs needed, {budget - spent[name]} left of {budget}"
                )
                staged.outcomes.append(outcome)
                continue
            chosen[name][axis] = incumbent
            scores[name][_key(chosen[name])] = best_so_far  # the same run as the last stage's best
            outcomes[name] = outcome
            points[name] = [{**chosen[name], axis: v} for v in new]
        if points:
            _stage(points, axis, axis, outcomes)
            settle(axis, outcomes)
        staged.outcomes.extend(outcomes.values())
    return staged


def merged_report(name: str, uri: str, reports: Sequence[SweepReport]) -> SweepReport:
    """The tuning runs of every stage as one sweep report."""
    planned: list[PlannedRun] = [p for r in reports for p in r.planned]
    records = [rec for r in reports for rec in r.records]
    notices = [n for r in reports for n in r.notices]
    return SweepReport(name, uri, planned, records, notices)
