"""What the round driver runs and when it stops: a method's schedule of blocks (a phase's
setup, then its rounds) and the stop rules asked after every round (`TimeBudget`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from p4bench.engine.method import Method, Phase, Step

__all__ = [
    "BUDGET_CLOCK",
    "Block",
    "StopAfter",
    "TimeBudget",
    "budget_rule",
    "never",
    "schedule",
    "stop_reason",
]

# Asked after every round with `step`, the rounds finished so far over all phases: stop now?
StopAfter = Callable[[int], bool]
BUDGET_CLOCK: Callable[[], float] = time.monotonic  # seconds; tests replace it with a fake clock


class TimeBudget:
    """A `StopAfter` that is true once `minutes` of wall-clock time have passed since it
    was made (the run's `time_budget_min`). The driver asks it after each round, so a run
    stops after the first round that ends past the budget; that round (`overran_at`, its
    step) does not count: a run's results are those of the last round that finished within
    the budget, as the papers count rounds in a time budget (`p4bench.run.summary.
    within_budget`). The device launcher holds one for its peers (`plugins/p4bench_device/launcher.py`)."""

    def __init__(self, minutes: float, clock: Callable[[], float] | None = None) -> None:
        self.minutes = minutes
        self._clock = clock or BUDGET_CLOCK
        self.started = self._clock()
        self.overran_at: int | None = None  # the step of the first round that ended past the budget

    def spent(self) -> bool:
        return self._clock() - self.started >= 60.0 * self.minutes

    def __call__(self, step: int) -> bool:
        spent = self.spent()
        if spent and self.overran_at is None:
            self.overran_at = step
        return spent


def never(step: int) -> bool:
    """The stop rule of a run without one."""
    return False


def budget_rule(minutes: float | None) -> StopAfter:
    """The stop rule of a run's `time_budget_min`: a `TimeBudget` from now, or `never`."""
    return TimeBudget(minutes) if minutes is not None else never


def stop_reason(
    step: int,
    extra_accuracy: dict[str, Any],
    stop_after: StopAfter,
    method: Method,
    holds_everyone: bool = True,
) -> str | None:
    """Whether a run ends after the round that brought it to `step`, decided in this one
    place for the simulator's driver and the device launcher: ``"method"`` when the
    method's own stopping rule holds on every client's values (P4L's mrt/mrr; judged only
    by a node that holds every client), ``"stop"`` when the stop rule says so (the time
    budget, a stop request), None to go on. The stop rule is asked after every round, so a
    `TimeBudget` records the round that overran it even when the method's rule ends the run."""
    stop = stop_after(step)
    if holds_everyone and method.finished(extra_accuracy):
        return "method"
    return "stop" if stop else None


@dataclass(frozen=True)
class Block:
    """A stretch of steps the driver runs and reports as one: a phase's setup
    (`round` = -1) or one round."""

    kind: str  # "setup" | "round"
    phase: Phase
    round: int
    steps: Sequence[Step]


def schedule(method: Method) -> Iterator[Block]:
    """The method's blocks in execution order; every process of a run walks the same
    sequence (the device launcher collects reports in this order)."""
    for phase in method.phases():
        if phase.setup:
            yield Block("setup", phase, -1, phase.setup)
        for round_index in range(phase.rounds):
            yield Block("round", phase, round_index, method.round_steps(phase, round_index))
