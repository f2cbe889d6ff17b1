"""`check_attack` and `check_defense`: threat plugins against the engine's contract.

Attack checks:
- ``tamper``: `tamper` keeps the messages' number, senders, receivers, payload keys and
  shapes, returns finite values and is a function of its random stream (same stream,
  same result); ``labels``: `poison_labels` keeps shape, dtype and the class range.
- ``needs``: on each of `methods`, an accepted attack changes the outcome; a refusal
  is justified (the attack poisons no labels and the method sends no ``update.*``
  payload); `needs_individual_updates` holds where it is accepted.
- ``runtimes``: an attacked run agrees across runtimes, `accelerator` included (the
  simulation on the emulated accelerator of `p4bench.testing.emulated_device`, which
  fails where a tensor is misplaced for a GPU). ``options``: as for methods.

Defense checks:
- ``aggregate``: shapes, kept updates a subset of the real ones, never all dropped,
  `filters` False means nothing dropped, padding changes nothing, identical updates
  aggregate to themselves; a NaN update and a sender's repeated update are reported
  dropped and the aggregate stays finite (the screen every `Defense` runs behind).
- ``needs``: on each of `methods`, an accepted defense is reached (the method
  aggregates through `ctx.aggregator`); a refused one is justified (nothing reaches
  the aggregator there).
- ``runtimes``: a defended, attacked run agrees across runtimes (`accelerator` included).
  ``options``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.engine.threats import Attack
from p4bench.errors import IncompatibleError
from p4bench.rng import ClientRng, node_keys
from p4bench.testing.emulated_device import accelerator_scope
from p4bench.testing.option_checks import check_options
from p4bench.testing.report import ConformanceReport
from p4bench.testing.runs import (
    compare_outcomes,
    make_config,
    names,
    resolve_plugin,
    run_config,
    runtime_config,
)

__all__ = ["ATTACK_CHECKS", "DEFENSE_CHECKS", "check_attack", "check_defense"]

ATTACK_CHECKS = ("tamper", "labels", "needs", "runtimes", "options")
DEFENSE_CHECKS = ("aggregate", "needs", "runtimes", "options")
METHODS = ("fedavg", "dp-dsgd", "local")
RUNTIMES = ("simulation", "reference", "bytes", "accelerator")
_CLASSES = 10


def check_attack(
    attack: str | type,
    *,
    methods: Sequence[str] = METHODS,
    checks: Sequence[str] = ATTACK_CHECKS,
    skip: Sequence[str] = (),
    runtimes: Sequence[str] = RUNTIMES,
    atol: float = 1e-5,
    plugin_manager: Any = None,
    raise_on_failure: bool = True,
    **overrides: Any,
) -> ConformanceReport:
    """Conformance checks of an attack (registered name or `Attack` subclass) against
    `methods` (registered names); `overrides` are `RunConfig` fields. Raises
    `ConformanceError` on failure unless `raise_on_failure` is False."""
    name, cls, pm = resolve_plugin("attack", attack, plugin_manager)
    wanted = [c for c in names(checks) if c not in names(skip)]
    report = ConformanceReport("attack", name, skipped=frozenset(names(skip)))
    base = make_config(overrides, no_dp=True, attack=name, defense="none")
    instance = cls(base, _CLASSES)
    if "tamper" in wanted:
        _check_tamper(report, cls, instance)
    if "labels" in wanted:
        _check_labels(report, cls, instance)
    accepted = _accepted(cls, methods, pm)
    if "needs" in wanted:
        for method in names(methods):
            _check_attack_on(report, cls, base.replace(method=method), pm, method in accepted)
    first = next((m for m in names(methods) if m in accepted), None)
    if "runtimes" in wanted:
        _check_runtimes(
            report, base.replace(method=first) if first else None, pm, names(runtimes), atol
        )
    if "options" in wanted:
        if first is None:
            report.skip("options", "no method of the check accepts the attack")
        else:
            check_options(report, cls, base.replace(method=first), pm, kind="attack")
    return report.raise_on_failure() if raise_on_failure else report


def check_defense(
    defense: str | type,
    *,
    methods: Sequence[str] = METHODS + ("proxyfl",),
    attack: str | None = "byzantine-random",
    checks: Sequence[str] = DEFENSE_CHECKS,
    skip: Sequence[str] = (),
    runtimes: Sequence[str] = RUNTIMES,
    atol: float = 1e-5,
    plugin_manager: Any = None,
    raise_on_failure: bool = True,
    **overrides: Any,
) -> ConformanceReport:
    """Conformance checks of a defense (registered name or `Defense` subclass) against
    `methods`, attacked by `attack` where it applies; `overrides` are `RunConfig`
    fields. Raises `ConformanceError` on failure unless `raise_on_failure` is False."""
    name, cls, pm = resolve_plugin("defense", defense, plugin_manager)
    wanted = [c for c in names(checks) if c not in names(skip)]
    report = ConformanceReport("defense", name, skipped=frozenset(names(skip)))
    base = make_config(overrides, no_dp=True, defense=name)
    if "aggregate" in wanted:
        _check_aggregate(report, cls, base)
    accepted = _accepted(cls, methods, pm)
    if "needs" in wanted:
        for method in names(methods):
            _check_defense_on(report, cls, base.replace(method=method), pm, method in accepted)
    first = next((m for m in names(methods) if m in accepted), None)
    attacked = None
    if first is not None:
        attacked = base.replace(
            method=first, attack=attack if attack and _attack_fits(attack, first, pm) else None
        )
    if "runtimes" in wanted:
        _check_runtimes(report, attacked, pm, names(runtimes), atol)
    if "options" in wanted:
        if attacked is None:
            report.skip("options", "no method of the check accepts the defense")
        else:
            check_options(report, cls, attacked, pm, kind="defense")
    return report.raise_on_failure() if raise_on_failure else report


# -- shared -----------------------------------------------------------------------------------
def _accepted(cls: Any, methods: Sequence[str], pm: Any) -> set[str]:
    from p4bench.host.manager import Registry

    registry = Registry(pm)
    return {m for m in names(methods) if cls.incompatibility(_capabilities(registry, m)) is None}


def _attack_fits(attack: str, method: str, pm: Any) -> bool:
    from p4bench.host.manager import Registry

    registry = Registry(pm)
    attack_cls: Any = registry.get("attack", attack)
    return attack_cls.incompatibility(_capabilities(registry, method)) is None


def _capabilities(registry: Any, method: str) -> Any:
    method_cls: Any = registry.get("method", method)
    return method_cls.capabilities


def _refused_by_run(config: Any, pm: Any) -> str | None:
    """None when the run refuses `config` up front (IncompatibleError), else why not."""
    try:
        run_config(config, pm)
    except IncompatibleError:
        return None
    return "incompatibility() refuses it but the run started anyway"


def _check_runtimes(
    report: ConformanceReport, config: Any, pm: Any, runtimes: tuple[str, ...], atol: float
) -> None:
    if config is None:
        report.skip("runtimes", "no method of the check accepts the plugin")
        return
    expected = run_config(config, pm).result
    problems = []
    for runtime in [r for r in runtimes if r != "simulation"]:
        reference = expected
        if (
            runtime == "accelerator" and config.private
        ):  # accelerators draw seeded DP noise from the Philox streams
            reference = run_config(config.replace(noise_generator="philox"), pm).result
        try:
            with accelerator_scope() if runtime == "accelerator" else nullcontext():
                got = run_config(runtime_config(config, runtime), pm).result
        except Exception as exc:  # noqa: BLE001 - a runtime the plugin or method breaks on is a finding
            problems.append(f"the {runtime} run raised {type(exc).__name__}: {exc}")
            continue
        problems += compare_outcomes(f"{runtime} vs simulation", reference, got, atol, 1e-6)
    report.add(
        "runtimes",
        not problems,
        "; ".join(problems[:3]) or f"{config.method}: {', '.join(runtimes)} agree",
    )


def _params_differ(a: Any, b: Any) -> bool:
    x, y = a.outcome.final_params, b.outcome.final_params
    return any(
        not torch.allclose(x[k].double(), y[k].double(), atol=1e-7, equal_nan=True) for k in x
    )


# -- attacks ------------------------------------------------------------------------------------
def _messages(n: int = 4, width: int = 6) -> Messages:
    generator = torch.Generator().manual_seed(0)
    payload = {
        f"{UPDATE_PREFIX}weight": torch.randn(n, 2, width // 2, generator=generator),
        f"{UPDATE_PREFIX}bias": torch.randn(n, 2, generator=generator),
        "weight": torch.ones(n, dtype=torch.float64),
    }
    return Messages(torch.arange(n), torch.full((n,), -1), payload)


def _check_tamper(report: ConformanceReport, cls: Any, attack: Any) -> None:
    if cls.tamper is Attack.tamper:
        report.skip("tamper", "the attack does not tamper with messages")
        return
    messages, problems = _messages(), []
    width = sum(v[0].numel() for k, v in messages.payload.items() if k.startswith(UPDATE_PREFIX))
    for reference in (
        None,
        torch.randn(len(messages), width, generator=torch.Generator().manual_seed(1)),
    ):
        outs = []
        for _ in range(2):
            rng = ClientRng(node_keys(0, messages.src, 2))
            known = (
                {"observed": _messages(6), "colluding": Messages.empty()} if cls.omniscient else {}
            )
            outs.append(attack.tamper("upload", messages, rng, reference, **known))
        out = outs[0]
        where = "with a reference model" if reference is not None else "on models"
        if not isinstance(out, Messages) or len(out) != len(messages):
            count = len(out) if isinstance(out, Messages) else "?"
            problems.append(
                f"{where}: returns {type(out).__name__} of {count} messages, expected {len(messages)}"
            )
            continue
        if not (torch.equal(out.src, messages.src) and torch.equal(out.dst, messages.dst)):
            problems.append(f"{where}: changes senders or receivers")
        for key, value in out.payload.items():
            if key not in messages.payload or value.shape != messages.payload[key].shape:
                problems.append(
                    f"{where}: payload '{key}' of shape {tuple(value.shape)} is not in the messages it got"
                )
            elif value.is_floating_point() and not bool(value.isfinite().all()):
                problems.append(f"{where}: payload '{key}' is not finite")
        if not all(torch.equal(out.payload[k], outs[1].payload[k]) for k in out.payload):
            problems.append(
                f"{where}: two calls with the same random stream differ (use the rng it is given)"
            )
    report.add(
        "tamper",
        not problems,
        "; ".join(problems[:3]) or "keeps the message layout, finite, reproducible",
    )


def _check_labels(report: ConformanceReport, cls: Any, attack: Any) -> None:
    labels = torch.randint(0, _CLASSES, (3, 20), generator=torch.Generator().manual_seed(2))
    extra = (
        {"rng": ClientRng(node_keys(0, [0, 1, 2], 2))}
        if getattr(cls, "random_poisoning", False)
        else {}
    )
    out = attack.poison_labels(labels.clone(), **extra)
    if cls.poison_labels is Attack.poison_labels:
        report.skip("labels", "the attack does not poison labels")
    elif (
        not isinstance(out, torch.Tensor) or out.shape != labels.shape or out.dtype != labels.dtype
    ):
        report.fail(
            "labels",
            f"poison_labels returns {getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}, "
            f"expected {tuple(labels.shape)} {labels.dtype}",
        )
    elif bool(((out < 0) | (out >= _CLASSES)).any()):
        report.fail("labels", f"poison_labels returns labels outside [0, {_CLASSES})")
    else:
        report.ok("labels", "same shape, dtype and class range")


def _check_attack_on(
    report: ConformanceReport, cls: Any, config: Any, pm: Any, accepted: bool
) -> None:
    label = f"needs.{config.method}"
    honest = run_config(config.replace(attack=None), pm, instrument=True)
    updates = honest.recorder.individual_updates
    sends_updates = updates > 0 or honest.recorder.self_messages > 0
    if accepted:
        attacked = run_config(config, pm)
        problems = (
            []
            if _params_differ(honest.result, attacked.result)
            else ["accepted, but the attacked run ends exactly like the honest one"]
        )
        if cls.needs_individual_updates and updates == 0:
            problems.append(
                "declares needs_individual_updates, yet is accepted where no node receives another's update"
            )
        report.add(
            label, not problems, "; ".join(problems) or "accepted, and it changes the outcome"
        )
        return
    poisons = cls.poison_labels is not Attack.poison_labels
    problems = [why for why in [_refused_by_run(config, pm)] if why]
    if poisons:
        problems.append("refused, though it poisons labels, which acts on any method")
    elif sends_updates and not cls.needs_individual_updates:
        problems.append(
            f"refused, though the method sends update.* payloads ({updates} to other nodes)"
        )
    report.add(
        label, not problems, "; ".join(problems) or "refused: the method sends nothing it acts on"
    )


# -- defenses -----------------------------------------------------------------------------------
def _aggregate(
    cls: Any, config: Any, updates: torch.Tensor, mask: torch.Tensor, senders: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    defense = cls(config)
    if getattr(cls, "needs_oracle", False):
        defense.reveal_malicious(torch.tensor([True] + [False] * (config.clients - 1)))
    weights = mask.double()
    # as the Aggregator calls it: the screen always gets the ids, the rule per uses_identities
    # annotated: what the Defense contract promises (the caller checks the shapes)
    aggregated: tuple[torch.Tensor, torch.Tensor] = defense.aggregate(
        updates, weights, mask, receivers=torch.arange(len(updates)), senders=senders
    )
    return aggregated


def _check_aggregate(report: ConformanceReport, cls: Any, base: Any) -> None:
    config = base.replace(clients=max(base.clients, 6))
    count, width, size = 3, 5, 7
    generator = torch.Generator().manual_seed(3)
    updates = torch.randn(count, width, size, generator=generator)
    mask = torch.ones(count, width, dtype=torch.bool)
    mask[2, 3:] = False
    updates[~mask] = 0.0
    senders = torch.where(
        mask, torch.arange(width).expand(count, width), torch.full((count, width), -1)
    )
    problems: list[str] = []
    combined, kept = _aggregate(cls, config, updates, mask, senders)
    if (
        tuple(combined.shape) != (count, size)
        or tuple(kept.shape) != (count, width)
        or kept.dtype != torch.bool
    ):
        report.fail(
            "aggregate",
            f"returns {tuple(combined.shape)} and {tuple(kept.shape)} {kept.dtype}, "
            f"expected ({count}, {size}) and ({count}, {width}) bool",
        )
        return
    if bool((kept & ~mask).any()):
        problems.append("keeps padded slots (mask False)")
    if not bool(kept.any(dim=1).all()):
        problems.append("drops every update of a receiver")
    if not cls.filters and bool((mask & ~kept).any()):
        problems.append(
            "declares filters=False but drops updates (detection scores would be wrong)"
        )
    if not bool(combined.isfinite().all()):
        problems.append("returns non-finite aggregates")
    alone, _ = _aggregate(cls, config, updates[:, :3], mask[:, :3], senders[:, :3])  # ids kept
    if not torch.allclose(alone[2], combined[2], atol=1e-4):
        problems.append(
            f"padding changes the aggregate (by {float((alone[2] - combined[2]).abs().max()):.3g})"
        )
    same = torch.full((1, width, size), 0.01).expand(count, width, size).clone() * mask.unsqueeze(
        -1
    )
    unanimous, _ = _aggregate(cls, config, same, mask, senders)
    if not torch.allclose(unanimous, torch.full_like(unanimous, 0.01), atol=1e-4):
        problems.append("identical updates do not aggregate to themselves")
    hostile, repeated = updates.clone(), senders.clone()
    hostile[:, 1] = float("nan")
    repeated[:2, 4] = repeated[:2, 3]  # receivers 0 and 1: slot 4 comes from slot 3's sender again
    screened, kept = _aggregate(cls, config, hostile, mask, repeated)
    if not bool(screened.isfinite().all()) or bool(kept[:, 1].any()) or bool(kept[:2, 4].any()):
        problems.append(
            "keeps a NaN update or a sender's repeated update, or returns a non-finite aggregate "
            "(the screen of p4bench.engine.screen was bypassed)"
        )
    report.add(
        "aggregate",
        not problems,
        "; ".join(problems) or "shapes, masks, padding and unanimity hold",
    )


def _check_defense_on(
    report: ConformanceReport, cls: Any, config: Any, pm: Any, accepted: bool
) -> None:
    label = f"needs.{config.method}"
    if accepted:
        probe = run_config(config, pm, instrument=True)
        reached = probe.recorder.aggregations
        report.add(
            label,
            reached > 0,
            f"accepted, and reached {reached} times"
            if reached
            else "accepted, but no update ever reached it: the method aggregates nothing through ctx.aggregator",
        )
        return
    probe = run_config(config.replace(defense="none"), pm, instrument=True)
    problems = [why for why in [_refused_by_run(config, pm)] if why]
    if probe.recorder.aggregations:
        problems.append(
            f"refused, though the method aggregates {probe.recorder.aggregated_updates} updates through ctx.aggregator"
        )
    report.add(label, not problems, "; ".join(problems) or "refused: the method aggregates nothing")
