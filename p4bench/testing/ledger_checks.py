"""The ``ledger`` checks of `check_method` (`p4bench.testing.methods`), on a private
instrumented run: every release the DP mechanism reports reaches the privacy ledger; each
client's noise draws match its recorded releases, per phase (fused draws counted per
phase); the records match the method's `privacy_plan()` (phases, sample rates, steps) and
no budget stops a client; a method that trains or sends models without `ctx.dp` fails."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.testing.report import ConformanceReport
from p4bench.testing.runs import Instrumented

if TYPE_CHECKING:
    from p4bench.engine.method import PlannedRelease

__all__ = ["check_ledger", "ledger_zero"]


def check_ledger(report: ConformanceReport, probe: Instrumented) -> None:
    """The ``ledger`` checks of a private instrumented run (`p4bench.testing.methods`)."""
    rec, ledger, method = probe.recorder, probe.ledger, probe.method
    if ledger is None:
        report.fail("ledger", "the run is private but has no ledger")
        return
    if rec.mechanisms == 0 or rec.uninstrumented:
        report.fail(
            "ledger",
            f"the DP mechanism could not be observed ({rec.uninstrumented or 'none built'})",
        )
        return
    recorded = _ledger_steps(ledger)
    phases = sorted(set(recorded) | set(rec.releases) | set(rec.noise_numbers))
    # 1. what the mechanism reported is what the ledger holds
    lost = [
        p
        for p in phases
        if not np.array_equal(
            rec.releases.get(p, ledger_zero(ledger)), recorded.get(p, ledger_zero(ledger))
        )
    ]
    report.add(
        "ledger.reported",
        not lost,
        f"releases of phase(s) {lost} differ between the mechanism and the ledger"
        if lost
        else f"{int(sum(v.sum() for v in recorded.values()))} client releases recorded",
    )
    # 2. noise draws against releases, per client and phase
    problems = []
    for phase in phases:
        releases = recorded.get(phase, ledger_zero(ledger))
        if phase in rec.batched_phases:  # several releases' noise in one draw: count presence
            drawn = rec.noise_numbers.get(phase, ledger_zero(ledger)) > 0
            for c in np.flatnonzero(drawn != (releases > 0)):
                problems.append(
                    f"client {c}, phase '{phase}': {releases[c]} releases, "
                    f"{rec.noise_numbers[phase][c] if phase in rec.noise_numbers else 0} normals drawn"
                )
            continue
        events = rec.noise_events.get(phase, ledger_zero(ledger))
        for c in np.flatnonzero(events != releases):
            problems.append(
                f"client {c}, phase '{phase}': {releases[c]} releases recorded, noise drawn {events[c]} times"
            )
    total = int(sum(v.sum() for v in recorded.values()))
    if total and not any(v.any() for v in rec.noise_numbers.values()):
        problems = [
            f"{total} client releases recorded but no noise drawn from any client's stream: the releases "
            "are not privatised by ctx.dp (noise added elsewhere, e.g. by a server, is not counted here)"
        ]
    moved = _moved(probe)
    if total == 0 and (moved or rec.exchanges.total()):
        problems.insert(
            0,
            "no release reached the ledger, yet the clients "
            + ("trained" if moved else "sent messages")
            + ": training must go through ctx.dp (local_sgd, batch_gradient, ctx.dp.sgd/step/release)",
        )
    report.add(
        "ledger.noise",
        not problems,
        "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        if problems
        else "every release drew its noise"
        + (" (fused draws: counted per phase)" if rec.batched_phases else ""),
    )
    # 3. the plan the noise was calibrated for
    _check_plan(report, method.privacy_plan(), recorded, ledger)


def ledger_zero(ledger: Any) -> np.ndarray:
    return np.zeros(ledger.num_clients, np.int64)


def _ledger_steps(ledger: Any) -> dict[str, np.ndarray]:
    """(M,) releases per phase, summed over the ledger's (phase, rate, sigma) keys."""
    out: dict[str, np.ndarray] = {}
    for key, steps in ledger.steps.items():
        out[key[0]] = out.get(key[0], ledger_zero(ledger)) + np.asarray(steps, np.int64)
    return out


def _check_plan(
    report: ConformanceReport,
    plan: list[PlannedRelease],
    recorded: dict[str, np.ndarray],
    ledger: Any,
) -> None:
    problems = []
    planned = {p.phase: p for p in plan if p.steps > 0}
    for phase, steps in recorded.items():
        if steps.any() and phase not in planned:
            problems.append(
                f"phase '{phase}' released {int(steps.sum())} times but privacy_plan() plans no releases there"
            )
    for key in ledger.steps:
        phase, rate = key[0], key[1]
        if phase in planned and not math.isclose(rate, planned[phase].sample_rate, rel_tol=1e-9):
            problems.append(
                f"phase '{phase}' released at sample rate {rate}, privacy_plan() says {planned[phase].sample_rate}"
            )
    for phase, p in planned.items():
        steps = recorded.get(phase, ledger_zero(ledger))
        if p.client_rate >= 1.0:
            wrong = np.flatnonzero(steps != p.steps)
            if len(wrong):
                problems.append(
                    f"phase '{phase}': privacy_plan() plans {p.steps} releases per client, the ledger "
                    f"recorded {steps[wrong].tolist()} for clients {wrong.tolist()}"
                )
        elif (
            not (0.5 * p.steps <= steps.mean() <= 1.5 * p.steps)
            or steps.max() > p.local_steps * p.rounds
        ):
            problems.append(
                f"phase '{phase}': privacy_plan() plans {p.steps} releases for a typical client "
                f"(client rate {p.client_rate}), the ledger recorded {steps.tolist()}"
            )
    if bool(np.asarray(ledger.stopped).any()):
        problems.append(
            f"the budget stopped clients {np.flatnonzero(ledger.stopped).tolist()}: they released more "
            "than privacy_plan() declares, so the noise was calibrated for too few releases"
        )
    report.add(
        "ledger.plan",
        not problems,
        "; ".join(problems[:3])
        or ", ".join(f"{p.phase}: {p.steps} releases per client" for p in planned.values())
        or "no releases planned",
    )


def _moved(probe: Instrumented) -> bool:
    """Whether any client deploys parameters other than the initial ones."""
    final = probe.result.outcome.final_params
    for key, start in probe.initial.items():
        if key in final and not torch.allclose(
            final[key].double(), start.double().expand_as(final[key]), atol=1e-7
        ):
            return True
    return False
