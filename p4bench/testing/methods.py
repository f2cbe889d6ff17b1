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

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from p4bench.testing.emulated_device import accelerator_scope
from p4bench.testing.ledger_checks import check_ledger
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
            check_ledger(report, probe)
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
