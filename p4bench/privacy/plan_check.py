"""The method's declared releases against what its ledger recorded.

A method declares its DP releases (`Method.privacy_plan()`): the noise is calibrated for
them, and bounds that need the schedule read them. The ledger records what really went
through the DP mechanism. A run whose two disagree is not certified, whatever the
accountant says, because a declaration is not evidence:

- a phase the plan declares steps for ran, and the ledger recorded no release in it
  (the method trained without the DP mechanism, e.g. through `ctx.loss_and_grad`
  alone: its epsilon would read 0);
- the ledger recorded releases in a phase, or at a sampling rate, the plan does not
  declare (the noise was calibrated without them);
- a client made more releases in a phase than the plan declares for it, where every
  client takes part in every round (client_rate 1);
- a private run whose plan declares no release at all.

Clients that take more or fewer steps than a typical one (client sampling, the budget
stopping a client, a time budget) are expected: the epsilon is the ledger's, per client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plan_reasons"]


def plan_reasons(
    ledger: Any, plan: Sequence[Any], phases: Mapping[str, Mapping[str, int]] | None
) -> list[str]:
    """Why the ledger of a finished private run does not match the method's `plan`
    (`PlannedRelease` entries); `phases` is the summary's rounds completed per phase."""
    planned: dict[str, list[float]] = {}
    most: dict[
        str, int | None
    ] = {}  # releases one client can make in the phase (None: client sampling)
    for entry in plan:
        if entry.steps > 0:
            planned.setdefault(entry.phase, []).append(float(entry.sample_rate))
            everyone = float(getattr(entry, "client_rate", 1.0)) >= 1.0
            bound = most.get(entry.phase, 0)
            most[entry.phase] = bound + int(entry.steps) if everyone and bound is not None else None
    if not planned:
        return [
            "a private run whose privacy_plan() declares no DP release: nothing the method computes from its "
            "clients' records is covered by the ledger"
        ]
    reasons, recorded = [], dict.fromkeys(planned, 0)
    for phase, rate, _sigma in ledger.keys:
        total = int(ledger.steps[(phase, rate, _sigma)].sum())
        if phase not in planned:
            reasons.append(
                f"the ledger recorded {total} release(s) in phase '{phase}', which privacy_plan() does not "
                "declare (the noise was calibrated without them)"
            )
            continue
        recorded[phase] += total
        if not any(math.isclose(rate, r, rel_tol=1e-9) for r in planned[phase]):
            reasons.append(
                f"releases in phase '{phase}' at sampling rate {rate:g}; privacy_plan() declares "
                f"{', '.join(f'{r:g}' for r in sorted(planned[phase]))}"
            )
    for phase, bound in most.items():
        counts = [ledger.steps[key] for key in ledger.keys if key[0] == phase]
        largest = int(sum(counts).max()) if counts else 0
        if bound is not None and largest > bound:
            reasons.append(
                f"a client made {largest} releases in phase '{phase}'; privacy_plan() declares {bound} "
                "(the noise was calibrated for fewer)"
            )
    everyone_stopped = bool(ledger.stopped.all())  # the budget can end every client before a phase
    for phase, total in recorded.items():
        ran = int((phases or {}).get(phase, {}).get("completed", 0))
        if total == 0 and ran > 0 and not everyone_stopped:
            reasons.append(
                f"privacy_plan() declares DP steps in phase '{phase}', but the ledger recorded no release in "
                f"its {ran} round(s): the method trained without the DP mechanism (ctx.dp)"
            )
    return reasons
