"""Declared options round-trip (`p4bench.options`): for every `Option` a plugin declares,

- its default is itself a valid value, and a run with defaults resolves it;
- some non-default valid value (another choice, the other boolean, a number in range)
  is resolved by the run (`validate_run_options`, what `prepare` does before any data)
  to exactly that value, and the plugin accepts it when constructed;
- invalid values (text for a number, a number out of range, an unknown choice) raise
  ConfigError naming ``options.<name>``, both from `resolve_options` and from the run.

Free-form strings and mappings have no generic valid/invalid value: they are checked
for their default only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p4bench.errors import ConfigError, P4BenchError
from p4bench.testing.report import ConformanceReport

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = ["check_options", "invalid_values", "valid_values"]

_NUMBERS = (0.0, 0.5, 1.0, 2.0, 3.0, 10.0)


def valid_values(option: Any) -> list[Any]:
    """Candidate non-default values that the declaration itself accepts."""
    default = option.default
    if option.choices:
        pool: list[Any] = [c for c in option.choices]
    elif option.type is bool:
        pool = [True, False]
    elif option.type in (int, float):
        base = [option.low, option.high, *_NUMBERS]
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            base += [default * 0.5, default * 2, default + 1, default - 1]
        if option.low is not None and option.high is not None:
            base.append((option.low + option.high) / 2)
        if option.low is not None:
            base.append(option.low + 1)
        pool = [
            option.type(v) if option.type is float else v
            for v in base
            if v is not None and math.isfinite(v)
        ]
        if option.type is int:
            pool = [int(v) for v in pool if float(v).is_integer()]
    else:
        return []
    out: list[Any] = []
    for value in pool:
        if value == default or value in out:
            continue
        try:
            option.resolve(value, f"options.{option.name}")
        except ConfigError:
            continue
        out.append(value)
    return out


def invalid_values(option: Any) -> list[Any]:
    """Values the declaration must refuse."""
    if option.choices:
        numeric = option.type in (int, float)
        return [max(option.choices) + 1 if numeric else "no-such-choice"]
    if option.type is bool:
        return ["maybe"]
    if option.type in (int, float):
        out: list[Any] = ["not-a-number"] + ([1.5] if option.type is int else [])
        if option.low is not None:
            out.append(option.low if option.low_open else option.low - 1)
        if option.high is not None:
            out.append(option.high if option.high_open else option.high + 1)
        return out
    if option.type is dict:
        return [42]
    return []


def check_options(
    report: ConformanceReport, cls: type, config: Any, pm: Any, kind: str = "method"
) -> None:
    """Add one ``options.<name>`` result per option `cls` declares (a skip when none).
    `config` is a run config that uses `cls` as its `kind` plugin."""
    try:
        from p4bench.options import declared_options, resolve_options, validate_run_options
    except ImportError:  # a p4bench without declared options
        report.skip("options", "this p4bench has no p4bench.options")
        return
    from p4bench.host.manager import Registry
    from p4bench.run.runner import prepare

    declared = declared_options(cls)
    if not declared:
        report.skip("options", f"{cls.__name__} declares no options")
        return
    registry = Registry(pm)
    base_options = dict(config.options)
    try:
        prepared = prepare(config, registry)  # defaults: the whole run resolves
    except P4BenchError as exc:
        report.fail("options", f"a run with the default options does not start: {exc}")
        return
    build = _builder(kind, cls, prepared)
    for option in declared:
        label = f"options.{option.name}"
        problems: list[str] = []
        if option.default is not None:
            try:
                if option.resolve(option.default, label) != option.default:
                    problems.append(f"default {option.default!r} resolves to another value")
            except ConfigError as exc:
                problems.append(f"default {option.default!r} is not valid: {exc}")
        accepted, refusals = None, []
        for value in valid_values(option):
            given = {**base_options, option.name: value}
            try:
                resolved = validate_run_options(config.replace(options=given), registry).get(
                    kind, {}
                )
                if resolved.get(option.name) != value:
                    refusals.append(f"{value!r} resolved to {resolved.get(option.name)!r}")
                    continue
                build(config.replace(options=given))
            except P4BenchError as exc:
                refusals.append(f"{value!r}: {exc}")
                continue
            accepted = value
            break
        if accepted is None and valid_values(option):
            problems.append(
                "no valid non-default value was accepted (" + "; ".join(refusals[:3]) + ")"
            )
        for value in invalid_values(option):
            given = {**base_options, option.name: value}
            for where, call in (
                ("resolve_options", lambda g=given: resolve_options(declared, g)),
                (
                    "the run",
                    lambda g=given: validate_run_options(config.replace(options=g), registry),
                ),
            ):
                try:
                    call()
                except ConfigError as exc:
                    if getattr(exc, "field", label) != label:
                        problems.append(
                            f"{value!r} refused by {where} naming '{exc.field}', not '{label}'"
                        )
                    continue
                except Exception as exc:  # noqa: BLE001 - reported as the failure it is
                    problems.append(
                        f"{value!r} makes {where} raise {type(exc).__name__}, not ConfigError"
                    )
                    continue
                problems.append(f"invalid value {value!r} accepted by {where}")
        tried = [repr(v) for v in invalid_values(option)]
        summary = (
            f"default {option.default!r}"
            + (f", {accepted!r} accepted" if accepted is not None else "")
            + (f", {', '.join(tried)} refused" if tried else "")
        )
        report.add(label, not problems, "; ".join(problems[:3]) or summary)


def _builder(kind: str, cls: type, prepared: Any) -> Callable[[RunConfig], Any]:
    """Constructs the plugin under test for a config (its own option checks run there)."""
    job = prepared.job
    if kind == "method":
        return lambda config: cls(config, job.model, config.clients)
    if kind == "attack":
        return lambda config: cls(config, int(prepared.info.data.num_classes))
    return lambda config: cls(config)
