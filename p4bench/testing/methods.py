"""`check_method`: a method plugin against the engine's contract.

Checks (names as in the report; pick with `checks=`/`skip=`):
- ``state``: every state leaf is a tensor with one row per client of the call; losses
  are (C,); a node sends only as itself and to existing nodes; inboxes arrive sorted;
  the receive gate rejects none of the honest messages (`p4bench.engine.receive_gate`).
- ``runtimes``: the same seeded config gives the same deployed parameters, accuracies
  and bytes on the wire in `simulation`, `reference`, `bytes`, `accelerator` (the
  simulation on the emulated accelerator of `p4bench.testing.emulated_device`, which
  fails where a tensor is misplaced for a GPU; compared with DP noise from the Philox
  streams on both sides) and `device` (opt-in), with DP on and off.
- ``ledger``: with DP on, every release the mechanism reports reaches the ledger; each
  client's noise draws match its recorded releases, per phase; the records match
  `privacy_plan()` (phases, sample rates, steps) and no budget stops a client; a
  method that trains or sends models without `ctx.dp` fails.
- ``post-processing``: with DP on, a replay with every client's records replaced and
  every release forced to its recorded value sends identical messages
  (`p4bench.privacy.post_processing`); a difference names the message.
- ``capabilities``: each declared flag against what the run did: `uses_server` iff
  messages go to or come from the server; `shares_individual_updates` iff some node
  receives a single client's ``update.*`` payload; `has_aggregator` iff updates reach
  `ctx.aggregator` (where defenses act); `personalized` False: the clients deploy one
  model (identical with a server, within `consensus_tolerance` without), True: not all
  the same.
- ``options``: declared options round-trip (`p4bench.testing.options`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.testing.emulated_device import accelerator_scope
from p4bench.testing.option_checks import check_options
from p4bench.testing.report import ConformanceReport
from p4bench.testing.runs import (
    Instrumented,
    compare_outcomes,
    make_config,
    names,
    non_private,
    private,
    resolve_plugin,
    run_config,
    runtime_config,
)

if TYPE_CHECKING:
    from p4bench.engine.method import PlannedRelease

__all__ = ["METHOD_CHECKS", "check_method"]

METHOD_CHECKS = ("state", "runtimes", "ledger", "post-processing", "capabilities", "options")
RUNTIMES = ("simulation", "reference", "bytes", "accelerator")


def check_method(
    method: str | type,
    *,
    checks: Sequence[str] = METHOD_CHECKS,
    skip: Sequence[str] = (),
    runtimes: Sequence[str] = RUNTIMES,
    device: bool = False,
    privacy: Sequence[str] = ("dp", "no-dp"),
    epsilon: float = 8.0,
    atol: float = 1e-5,
    accuracy_atol: float = 1e-6,
    consensus_tolerance: float = 0.5,
    plugin_manager: Any = None,
    raise_on_failure: bool = True,
    **overrides: Any,
) -> ConformanceReport:
    """Run the conformance checks on a method (a registered name or a `Method` subclass,
    registered for the check if it is not) and return the report; raise
    `ConformanceError` (an AssertionError) listing the failures unless
    `raise_on_failure` is False.

    `overrides` are `RunConfig` fields over `runs.BASE_CONFIG` (4 clients, 2 rounds of
    2 steps, digits), e.g. ``clients=6, options={"mix": 0.3}``. `device=True` adds the
    device runtime (one process per client on 127.0.0.1, tens of seconds; the method
    must be importable by the peer processes, i.e. installed). `privacy` says in which
    modes runtimes are compared ("dp": at `epsilon`, or the config's own privacy).
    """
    name, cls, pm = resolve_plugin("method", method, plugin_manager)
    base = make_config(overrides, method=name)
    wanted = [c for c in names(checks) if c not in names(skip)]
    report = ConformanceReport("method", name, skipped=frozenset(names(skip)))
    dp_config = private(base, epsilon) if not base.no_dp else None
    probe: Instrumented | None = None
    if {"state", "ledger", "capabilities"} & set(wanted):
        try:
            probe = run_config(dp_config or base, pm, instrument=True)
        except Exception as exc:  # noqa: BLE001 - a crashing method is a finding, not a kit error
            report.fail(
                "run", f"the instrumented simulation run raised {type(exc).__name__}: {exc}"
            )
    if "state" in wanted and probe is not None:
        _check_state(report, probe)
    if "runtimes" in wanted:
        _check_runtimes(
            report,
            base,
            dp_config,
            pm,
            names(runtimes),
            device,
            names(privacy),
            atol,
            accuracy_atol,
        )
    if "ledger" in wanted and probe is not None:
        if dp_config is None:
            report.skip("ledger", "the config opts out of DP (no_dp)")
        else:
            _check_ledger(report, probe)
    if "post-processing" in wanted:
        _check_post_processing(report, dp_config, pm)
    if "capabilities" in wanted and probe is not None:
        _check_capabilities(report, cls, probe, consensus_tolerance)
    if "options" in wanted:
        check_options(report, cls, base.replace(runtime="simulation"), pm)
    return report.raise_on_failure() if raise_on_failure else report


# -- state and messages ---------------------------------------------------------------------
def _check_state(report: ConformanceReport, probe: Instrumented) -> None:
    rec = probe.recorder
    report.add(
        "state.layout",
        not rec.layout_errors,
        "; ".join(rec.layout_errors[:3]) or "every state leaf has one row per client",
    )
    report.add(
        "state.messages",
        not rec.message_errors,
        "; ".join(rec.message_errors[:3])
        or f"{rec.exchanges.total()} messages delivered, {rec.self_messages} to the sender itself",
    )
    rejected = probe.result.summary.rejections
    report.add(
        "state.receive-gate",
        not rejected,
        f"the receive gate rejected honest messages: {', '.join(f'{k} ({v})' for k, v in rejected.items())}; "
        "send finite values, declare messages_per_pair / payload_bounds where an honest sender needs more"
        if rejected
        else "every message passed the receive gate (counts, finite values, ranges)",
    )


# -- runtimes ----------------------------------------------------------------------------------
def _check_runtimes(
    report: ConformanceReport,
    base: Any,
    dp_config: Any,
    pm: Any,
    runtimes: tuple[str, ...],
    device: bool,
    modes: tuple[str, ...],
    atol: float,
    accuracy_atol: float,
) -> None:
    wanted = [r for r in runtimes if r != "simulation"] + (
        ["device"] if device and "device" not in runtimes else []
    )
    for mode in modes:
        config = dp_config if mode == "dp" else non_private(base) if mode == "no-dp" else None
        if config is None:
            report.skip(
                f"runtimes.{mode}",
                "the config opts out of DP" if mode == "dp" else f"unknown mode {mode!r}",
            )
            continue
        problems: list[str] = []
        expected = _attempt(lambda c=config: run_config(c, pm).result, "simulation", problems)
        for runtime in wanted if expected is not None else []:
            if runtime == "device" and mode != "dp":
                continue  # one device run: peers start in seconds, not milliseconds
            reference = expected
            if (
                runtime == "accelerator" and mode == "dp"
            ):  # accelerators draw seeded noise from the Philox streams
                reference = _attempt(
                    lambda c=config: run_config(c.replace(noise_generator="philox"), pm).result,
                    "simulation (philox noise)",
                    problems,
                )
            with accelerator_scope() if runtime == "accelerator" else nullcontext():
                got = _attempt(
                    lambda c=config, r=runtime: run_config(runtime_config(c, r), pm).result,
                    runtime,
                    problems,
                )
            if got is not None and reference is not None:
                problems += compare_outcomes(
                    f"{runtime} vs simulation", reference, got, atol, accuracy_atol
                )
        ran = ", ".join(["simulation", *[r for r in wanted if r != "device" or mode == "dp"]])
        report.add(f"runtimes.{mode}", not problems, "; ".join(problems[:4]) or f"{ran} agree")


def _attempt(run: Any, runtime: str, problems: list[str]) -> Any:
    """`run()`, or None with the exception added to `problems`."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a runtime the method breaks on is a finding
        problems.append(f"the {runtime} run raised {type(exc).__name__}: {exc}")
        return None


# -- post-processing ------------------------------------------------------------------------------
def _check_post_processing(report: ConformanceReport, dp_config: Any, pm: Any) -> None:
    """Every message must be post-processing of the DP releases (`p4bench.privacy.post_processing`)."""
    from p4bench.privacy.post_processing import check_post_processing, generic_path
    from p4bench.run.runner import run

    if dp_config is None:
        report.skip("post-processing", "the config opts out of DP (no_dp)")
        return
    try:
        config, _ = generic_path(dp_config.replace(rounds=max(dp_config.rounds, 2)))
        result = check_post_processing(config, run, pm)
    except Exception as exc:  # noqa: BLE001 - a crashing method is a finding, not a kit error
        report.fail("post-processing", f"the check's runs raised {type(exc).__name__}: {exc}")
        return
    isolation = {
        "verified": "; every release's clipped sum unchanged with half the records changed and out of every "
        "sum (record isolation)",
        "not checked": "; record isolation not checked (no per-example clipped batch held a changed record)",
    }
    report.add(
        "post-processing",
        result.passed,
        result.reason()
        or f"{result.messages} messages identical with every client's records replaced and {result.releases} "
        f"releases forced{isolation.get(result.isolation, '')}",
    )


# -- privacy ledger -----------------------------------------------------------------------------
def _check_ledger(report: ConformanceReport, probe: Instrumented) -> None:
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


# -- capabilities ---------------------------------------------------------------------------------
def _check_capabilities(
    report: ConformanceReport, cls: Any, probe: Instrumented, tolerance: float
) -> None:
    caps, rec = (
        getattr(probe.method, "capabilities", cls.capabilities),
        probe.recorder,
    )  # an instance may refine them
    sent = rec.exchanges.total()

    def flag(
        name: str, declared: bool, observed: bool, saw: str, missing: str, consequence: str
    ) -> None:
        if declared == observed:
            report.ok(
                f"capabilities.{name}", f"declared {declared}: {saw if observed else missing}"
            )
        else:
            report.fail(
                f"capabilities.{name}",
                f"declared {declared} but {saw if observed else missing}; {consequence}",
            )

    flag(
        "uses_server",
        caps.uses_server,
        rec.server_messages > 0,
        f"{rec.server_messages} messages went to or came from the server",
        "no message involved the server",
        "runtimes start a server node (and device runs a server peer) exactly when it is declared",
    )
    example = ", ".join(f"{e}: {s}->{d}" for e, s, d in rec.update_examples)
    flag(
        "shares_individual_updates",
        caps.shares_individual_updates,
        rec.individual_updates > 0,
        f"{rec.individual_updates} single-client update.* payloads were received by other nodes ({example})",
        f"no node received another client's update.* payload ({sent} messages)",
        "attacks and defenses decide compatibility from it",
    )
    flag(
        "has_aggregator",
        caps.has_aggregator,
        rec.aggregations > 0,
        f"{rec.aggregations} aggregations of {rec.aggregated_updates} updates reached ctx.aggregator",
        "no update reached ctx.aggregator (with a defense installed)",
        "defenses act only on what goes through ctx.aggregator, and are accepted from this flag",
    )
    _check_personalized(report, caps, probe.result.outcome.final_params, probe.initial, tolerance)


def _check_personalized(
    report: ConformanceReport,
    caps: Any,
    final: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    tolerance: float,
) -> None:
    keys = sorted(final)
    if not keys:
        report.skip("capabilities.personalized", "no deployed parameters")
        return
    flat = torch.cat([final[k].double().flatten(start_dim=1) for k in keys], dim=1)
    start = (
        torch.cat([initial[k].double().flatten() for k in keys])
        if all(k in initial for k in keys)
        else flat.mean(0)
    )
    centre = flat.mean(0)
    spread = float((flat - centre).norm(dim=1).mean())
    drift = float((centre - start).norm())
    identical = spread <= 1e-6 * max(1.0, float(flat.norm(dim=1).mean()))
    ratio = spread / drift if drift > 0 else float("inf") if spread > 0 else 0.0
    detail = f"mean distance to the clients' mean model {spread:.3g}, distance moved {drift:.3g}"
    if caps.personalized:
        report.add(
            "capabilities.personalized",
            not identical,
            f"declared True but every client deploys the same parameters ({detail})"
            if identical
            else f"declared True: clients deploy their own models ({detail})",
        )
    elif caps.uses_server:
        report.add(
            "capabilities.personalized",
            identical,
            f"declared False with a server, but the clients deploy different parameters ({detail})"
            if not identical
            else "declared False: every client deploys the server's model",
        )
    else:
        report.add(
            "capabilities.personalized",
            identical or ratio <= tolerance,
            f"declared False: consensus within {tolerance} ({detail})"
            if identical or ratio <= tolerance
            else f"declared False but the clients' models do not agree ({detail}, ratio {ratio:.2f} > {tolerance})",
        )
