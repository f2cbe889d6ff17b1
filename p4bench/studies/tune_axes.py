"""Tuning beyond lr in `p4bench reproduce`: the options the paper grid-searches, one
coordinate at a time, within a declared budget of runs, widening grids whose winner sits on
an edge.

Protocol (after lr is tuned, `p4bench.studies.preset_tuning`): every tuning group (a
method, or a method on one partition, `p4bench.studies.tune_scope`) starts from its tuned
lr. For each axis of `Preset.tune_axes` in order (the P4 paper's K, s, C, l), the group's
tuning run is repeated at every value of the axis with the values chosen so far held
fixed; the best mean score over the tuning seeds wins (ties keep the incumbent). The
incumbent point is the previous stage's best run: the sweep resumes it, so it costs no run.
This is coordinate search, not the full product grid the paper implies (K x l x s x eta_0 x C
has hundreds of points per method); the report says so.

- **Which axes a method gets**: those its training reads (`Method.tuning_options`, None:
  every axis), and `clip` only where the run is private.
- **Budget** (`Preset.tune_budget`, `--tune-budget`): the most tuning runs one group may
  spend, lr's grid included. An axis that does not fit is not tuned, and the report names it.
- **Edges**: a numeric axis whose winner is the smallest or largest value tried (lr
  included) is widened by one more step beyond it (the ratio of the last two values;
  clamped to the option's range), at most `WIDEN_STEPS` times while the budget lasts. A
  winner still on an edge after that is flagged "on the grid's edge"; one at the option's
  bound (e.g. a rate of 1) is not an edge.

Every figure comes from the evaluation clients alone, as lr's does; the tuning runs' own
privacy is reported with lr's (`p4bench.studies.tune_scope.tuning_lines`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.studies.sweep import PlannedRun
from p4bench.studies.sweep_plan import apply_option, option_key

__all__ = [
    "parse_grid_options",
    "WIDEN_STEPS",
    "AxisOutcome",
    "axes_for",
    "config_value",
    "edge_step",
    "tuning_config_at",
    "with_values",
]

WIDEN_STEPS = 2  # further values tried beyond an edge, per axis and group
_BOUNDS = {f.name: (f.metadata.get("low"), f.metadata.get("high")) for f in fields(RunConfig)}


@dataclass
class AxisOutcome:
    """What tuning one axis of one group found: every value tried with its mean score, the
    chosen value, how often the grid was widened, and whether the winner is still on an
    edge ("low" / "high") or was not tuned ("budget")."""

    group: str
    option: str
    scores: dict[Any, float] = field(default_factory=dict)
    chosen: Any = None
    widened: int = 0
    edge: str | None = None
    skipped: str | None = None  # why the axis was not tuned for this group

    def line(self) -> str:
        if self.skipped:
            return f"{self.group}: {self.option} not tuned ({self.skipped})"
        tried = ", ".join(f"{_text(v)}: {_score(s)}" for v, s in sorted(self.scores.items()))
        extra = f"; widened {self.widened}x" if self.widened else ""
        edge = f"; still on the grid's {self.edge} edge" if self.edge else ""
        flat = "; no effect on the score" if len(set(self.scores.values())) == 1 else ""
        return f"{self.group}: {self.option} = {_text(self.chosen)} ({tried}{extra}{edge}{flat})"


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _score(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4f}"


def config_value(config: RunConfig, key: str) -> Any:
    """The value of run option `key` (a field, or `options.<name>`) in `config`."""
    name = option_key(key)
    if name.startswith("options."):
        return config.options.get(name[len("options.") :])
    return getattr(config, name)


def with_values(config: RunConfig, values: Mapping[str, Any]) -> RunConfig:
    """`config` with each run option of `values` set (plugin options merged key by key)."""
    changes: dict[str, Any] = {"options": dict(config.options)}
    for key, value in values.items():
        apply_option(changes, key, value)
    return config.replace(**changes)


def tuning_config_at(
    group_run: PlannedRun, values: Mapping[str, Any], experiment: str, rounds: int | None
) -> RunConfig:
    """The reported run a group tunes at, with `values`, in the tuning experiment."""
    config = with_values(group_run.config, values)
    return config.replace(experiment=experiment, **({"rounds": rounds} if rounds else {}))


def axes_for(
    config: RunConfig,
    axes: Mapping[str, Sequence[Any]],
    tuning_options: Sequence[str] | None,
) -> dict[str, tuple[Any, ...]]:
    """The axes a run of this method is tuned on: those its training reads
    (`tuning_options`, None: all) and `clip` only for a private run."""
    private = not config.no_dp and (
        config.epsilon is not None or config.noise_multiplier is not None
    )
    chosen = {}
    for key, values in axes.items():
        name = option_key(key)
        if tuning_options is not None and name not in tuning_options:
            continue
        if name == "clip" and not private:
            continue
        chosen[name] = tuple(values)
    return chosen


def edge_step(key: str, tried: Sequence[Any], winner: Any) -> Any | None:
    """The next value beyond `winner` when it is the smallest or largest of `tried`
    (numbers only, two values or more), by the ratio of the edge's last two values and
    clamped to the option's range; None where the winner is inside the grid, at the
    option's bound, or the axis is not numeric."""
    numbers = sorted({v for v in tried if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if len(numbers) < 2 or winner not in numbers or numbers[0] <= 0:
        return None
    if winner == numbers[-1]:
        step = numbers[-1] / numbers[-2]
    elif winner == numbers[0]:
        step = numbers[0] / numbers[1]
    else:
        return None
    value = winner * step
    low, high = _BOUNDS.get(option_key(key), (None, None))
    if high is not None:
        value = min(value, high)
    if isinstance(winner, int):
        value = int(round(value))
        if value == winner:
            value = winner + (1 if step > 1 else -1)
        if low is not None and value < low:
            return None
    elif low is not None and value <= low:
        return None
    return None if value == winner or value in numbers else value


def edge_of(tried: Sequence[Any], winner: Any) -> str | None:
    """ "low" / "high" where the numeric winner is the smallest / largest value tried."""
    numbers = sorted({v for v in tried if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if len(numbers) < 2 or winner not in numbers:
        return None
    return "high" if winner == numbers[-1] else "low" if winner == numbers[0] else None


def at_bound(key: str, value: Any) -> bool:
    """Whether `value` is the option's own bound (a rate of 1): no edge to widen past."""
    low, high = _BOUNDS.get(option_key(key), (None, None))
    return (high is not None and value >= high) or (low is not None and value <= low)


def parse_grid_options(pairs: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    """`KEY=V1,V2,...` pairs from the command line (values parsed as YAML scalars)."""
    grid = {}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        if not sep or not key or not values:
            raise UsageError(f"--grid expects KEY=V1,V2,..., got {pair!r}")
        option_key(key)
        grid[key] = tuple(yaml.safe_load(v) for v in values.split(","))
    return grid
