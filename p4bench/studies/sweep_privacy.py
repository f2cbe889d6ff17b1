"""A sweep's privacy checks: one neighbouring relation for its private runs, settled
before anything trains, and a notice naming finished runs whose epsilon is uncertified,
declared reference rows apart (the rules are `p4bench.studies.equal_privacy`'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from p4bench.studies.equal_privacy import RunPrivacy, check_privacy, from_config, from_summary
from p4bench.studies.sweep_plan import REFERENCE, PlannedRun, SweepSpec, describe_run

if TYPE_CHECKING:
    from p4bench.studies.backends import RunRecord

__all__ = ["names_relation", "record_privacy", "study_privacy", "uncertified_notice"]


def names_relation(spec: SweepSpec) -> bool:
    """Whether the sweep file names a neighbouring relation anywhere."""
    keys = [
        *spec.base,
        *spec.axes,
        *(k for v in spec.variants for k in v),
        *(k for v in spec.per_method.values() for k in v),
    ]
    return any(str(k).replace("-", "_") == "neighbouring" for k in keys)


def study_privacy(
    spec: SweepSpec,
    planned: Sequence[PlannedRun],
    registry: Any = None,
    *,
    allow_mixed: bool = False,
    what: str | None = None,
) -> list[str]:
    """Check before anything trains that the private runs share one neighbouring relation
    (UsageError naming the runs otherwise, unless `allow_mixed`); the notices to show."""
    statuses = [from_config(run.config, describe_run(run), registry) for run in planned]
    verdict = check_privacy(
        statuses, allow_mixed=allow_mixed, what=what or f"sweep '{spec.name}'", certification=False
    )
    if not any(s.private for s in statuses):
        return []
    if verdict.relation is None:
        return [verdict.warning or ""]
    origin = (
        "named by the study"
        if names_relation(spec)
        else "the study default, as the study names none; set `neighbouring` in its base to choose"
    )
    return [
        f"one neighbouring relation for every private run of this study: {verdict.relation} ({origin}); "
        + verdict.note(certification=False)
    ]  # certification is known once the runs ran


def uncertified_notice(planned: Sequence[PlannedRun], records: Sequence[RunRecord]) -> str | None:
    """A notice naming the finished runs whose epsilon is uncertified."""
    statuses = [record_privacy(p, r) for p, r in zip(planned, records)]
    verdict = check_privacy([s for s in statuses if s is not None], allow_mixed=True)
    bad = [p for p in verdict.problems if p.startswith("uncertified")]
    return (
        f"{bad[0]}; tables of these runs are refused unless --allow-mixed-privacy" if bad else None
    )


def record_privacy(planned: PlannedRun, record: RunRecord) -> RunPrivacy | None:
    """The privacy of a finished (or skipped) run from its record, None for other records."""
    if record.status not in ("finished", "skipped"):
        return None
    return from_summary(
        {"method": planned.config.method, **record.summary},
        describe_run(planned),
        planned.tags.get(REFERENCE),  # a declared reference row may be uncertified
    )
