"""Tuning beyond lr (`p4bench.studies.tune_axes`, `tune_stages`): coordinate search over the
paper's axes, a budget of runs per group, widened edges, and the reported runs' values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from p4bench.config import RunConfig
from p4bench.studies.preset_tuning import apply_tuned_values
from p4bench.studies.sweep import PlannedRun
from p4bench.studies.tune_axes import axes_for, edge_step, with_values
from p4bench.studies.tune_stages import tune_axes_staged

LR_GRID = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Group:
    name: str
    run: PlannedRun


def _group(name: str = "p4", **config: Any) -> Group:
    base = {"method": "p4", "epsilon": 8.0, "local_steps": 5, "data_rate": 0.2, "clip": 1.0}
    return Group(name, PlannedRun(RunConfig(**{**base, **config}), {}))


def _score(values: dict[str, Any], best: dict[str, float]) -> float:
    """A smooth score peaked at `best` in log space: every axis matters."""
    total = 0.0
    for key, peak in best.items():
        value = float(
            values.get(key, {"local_steps": 5, "data_rate": 0.2, "clip": 1.0}.get(key, 1.0))
        )
        total -= math.log(value / peak) ** 2
    return total


class Stages:
    """A stage runner that scores points with `_score` and records what ran."""

    def __init__(self, best: dict[str, dict[str, float]]) -> None:
        self.best, self.ran, self.labels = best, [], []

    def __call__(self, points: dict[str, list[dict[str, Any]]], label: str) -> dict[str, list]:
        self.labels.append(label)
        found = {}
        for name, tried in points.items():
            self.ran.extend((name, dict(v)) for v in tried)
            found[name] = [(dict(v), _score(v, self.best[name])) for v in tried]
        return found


def _lr_scores(best: dict[str, float]) -> dict[float, float]:
    return {lr: _score({"lr": lr}, best) for lr in LR_GRID}


def _tune(groups, best, axes, budget=30, options=lambda method: None, fixed=()):
    stages = Stages(best)
    lr_scores = {g.name: _lr_scores(best[g.name]) for g in groups}
    lrs = {name: max(scores, key=scores.get) for name, scores in lr_scores.items()}
    staged = tune_axes_staged(groups, lr_scores, lrs, axes, options, budget, stages, fixed)
    return staged, stages


AXES = {"local_steps": (1, 5, 10), "data_rate": (0.1, 0.2, 0.5), "clip": (0.1, 1.0, 10.0)}


def test_each_axis_finds_the_peak_inside_its_grid():
    best = {"p4": {"lr": 0.5, "local_steps": 10, "data_rate": 0.1, "clip": 1.0}}
    staged, stages = _tune([_group()], best, {k: v for k, v in AXES.items()})
    assert staged.chosen["p4"]["lr"] == 0.5
    assert staged.chosen["p4"]["data_rate"] == 0.1
    assert staged.chosen["p4"]["clip"] == 1.0
    # the incumbent (5, 0.2, 1.0) is the previous stage's best run: never run again
    assert all(
        v.get("clip") != 1.0
        for _, v in stages.ran
        if set(v) == {"lr", "local_steps", "data_rate", "clip"}
    )
    assert stages.labels[:1] == ["local_steps"]


def test_a_winner_on_the_edge_is_widened_then_flagged():
    best = {"p4": {"lr": 50.0}}  # far above the grid: two widenings cannot reach it
    staged, stages = _tune([_group()], best, {})
    (lr,) = [o for o in staged.outcomes if o.option == "lr"]
    assert lr.widened == 2
    assert staged.chosen["p4"]["lr"] == pytest.approx(8.0)  # 2 -> 4 -> 8
    assert lr.edge == "high"
    assert "still on the grid's high edge" in lr.line()
    assert staged.edges() == [lr]


def test_widening_stops_when_it_finds_the_peak():
    best = {"p4": {"lr": 2.5, "local_steps": 5}}  # 2 beats the widened 4: inside now
    staged, _ = _tune([_group()], best, {})
    (lr,) = [o for o in staged.outcomes if o.option == "lr"]
    assert lr.widened == 1 and lr.edge is None
    assert staged.chosen["p4"]["lr"] == 2.0
    assert sorted(lr.scores) == [*LR_GRID, 4.0]


def test_a_rate_at_its_bound_is_not_an_edge():
    assert edge_step("client_rate", (0.5, 1.0), 1.0) is None
    assert edge_step("local_steps", (1, 5, 10), 1) is None  # K >= 1
    assert edge_step("local_steps", (1, 5, 10), 10) == 20
    assert edge_step("lr", (0.1, 1.0), 0.1) == pytest.approx(0.01)
    assert edge_step("data_rate", (0.1, 0.5), 0.5) == 1.0  # clamped to the rate's bound
    best = {"p4": {"lr": 0.5, "client_rate": 5.0}}
    staged, stages = _tune([_group(client_rate=1.0)], best, {"client_rate": (0.5, 1.0)})
    (rate,) = [o for o in staged.outcomes if o.option == "client_rate"]
    assert rate.chosen == 1.0 and rate.edge is None and rate.widened == 0


def test_the_budget_leaves_axes_untuned_and_says_so():
    best = {"p4": {"lr": 0.5, "local_steps": 10, "data_rate": 0.1, "clip": 1.0}}
    staged, stages = _tune([_group()], best, AXES, budget=len(LR_GRID) + 3)
    assert staged.spent["p4"] <= len(LR_GRID) + 3
    skipped = [o for o in staged.outcomes if o.skipped]
    assert {o.option for o in skipped} == {"data_rate", "clip"}
    assert "budget" in skipped[0].line()
    assert "data_rate" not in staged.chosen["p4"]


def test_only_the_axes_a_method_reads_and_clip_only_when_private():
    best = {
        "p4": {"lr": 0.5, "client_rate": 0.5},
        "local": {"lr": 0.5, "client_rate": 0.5},
    }
    groups = [_group(), _group("local", method="local", epsilon=None, no_dp=True)]
    options = {"p4": None, "local": ("local_steps", "data_rate", "clip")}
    staged, stages = _tune(
        groups, best, {"client_rate": (0.5, 1.0), "clip": (0.1, 1.0)}, options=options.get
    )
    assert "client_rate" in staged.chosen["p4"] and "client_rate" not in staged.chosen["local"]
    assert "clip" in staged.chosen["p4"] and "clip" not in staged.chosen["local"]
    assert {name for name, _ in stages.ran} == {"p4"}
    assert axes_for(groups[1].run.config, {"clip": (1.0,)}, None) == {}


def test_options_the_user_set_are_never_tuned():
    best = {"p4": {"lr": 0.5, "local_steps": 10}}
    staged, stages = _tune([_group()], best, AXES, fixed=("local_steps",))
    assert "local_steps" not in staged.chosen["p4"]
    assert all("local_steps" not in label for label in stages.labels)


def test_ties_keep_the_incumbent():
    class Flat(Stages):
        def __call__(self, points, label):
            super().__call__(points, label)
            return {n: [(dict(v), 1.0) for v in tried] for n, tried in points.items()}

    stages = Flat({"p4": {}})
    lr_scores = {"p4": {lr: 1.0 for lr in LR_GRID}}
    staged = tune_axes_staged(
        [_group()], lr_scores, {"p4": 0.05}, {"local_steps": (1, 5, 10)}, lambda m: None, 30, stages
    )
    assert staged.chosen["p4"]["local_steps"] == 5
    assert (
        "no effect on the score"
        in [o for o in staged.outcomes if o.option == "local_steps"][0].line()
    )


def test_the_reported_runs_take_their_groups_values():
    runs = [PlannedRun(RunConfig(method="p4", seed=s), {"variant": "a"}) for s in (0, 1)]

    @dataclass
    class Plan:
        assignment: list
        runs: list

    plan = Plan(["p4 @ a", "other"], runs)
    values = {"p4 @ a": {"lr": 0.2, "local_steps": 10, "options.teacher": "private"}}
    applied = apply_tuned_values(plan, values)
    assert (applied[0].config.lr, applied[0].config.local_steps) == (0.2, 10)
    assert applied[0].config.options["teacher"] == "private"
    assert applied[1].config == runs[1].config
    assert with_values(runs[0].config, {"clip": 2.0}).clip == 2.0


def test_a_budget_below_lrs_grid_is_one_line_and_exit_2(tmp_path, capsys):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            ["reproduce", "heterogeneity", "--quick", "--only", "method=local"]
            + ["--tune-budget", "1", "--results-dir", str(tmp_path / "runs")]
        )
    assert info.value.code == 2
    assert "--tune-budget 1 is below lr's grid of 2 runs" in capsys.readouterr().err
