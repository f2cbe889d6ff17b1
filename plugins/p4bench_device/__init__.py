"""The device runtime: the same protocol on real devices (Raspberry Pis) over TLS.

Registers the ``device`` runtime, the ``p4bench device init|serve|launch`` commands, and
adds a run's device measurements to its summary (``summary["device"]``).

The runtime is imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    import typer

    from p4bench.engine.runtime import Runtime
    from p4bench.records import RunInfo, RunResult
    from p4bench_device.launcher import DeviceOutcome
    from p4bench_device.runtime import DeviceRuntime

__all__ = ["DeviceRuntime", "DeviceOutcome"]

__getattr__ = lazy_exports(
    globals(),
    {"p4bench_device.launcher": ("DeviceOutcome",), "p4bench_device.runtime": ("DeviceRuntime",)},
)


@hookimpl
def register_runtimes() -> list[type[Runtime]]:
    from p4bench_device.runtime import DeviceRuntime

    return [DeviceRuntime]


@hookimpl
def register_commands(app: typer.Typer) -> None:
    from p4bench_device.cli import register  # typer is only needed when the CLI is built

    register(app)


@hookimpl(tryfirst=True)
def run_finished(run: RunInfo, result: RunResult) -> None:
    """Before the tracker writes summary.json: per-peer, per-phase measurements and drops;
    a peer's release report that disagrees with the launcher's figures makes the run
    uncertified (`report_check`), before the tracker tags it."""
    device: dict[str, Any] | None = getattr(
        result.outcome, "device", None
    )  # a DeviceOutcome's (not imported: torch)
    if device is None:
        return
    certification = run.certification
    if certification is not None and certification.private:
        from p4bench_device.report_check import mismatch_reasons

        run.certification = certification.with_reasons(mismatch_reasons(device.get("releases")))
    result.summary = dataclasses.replace(
        result.summary, device=device, certification=run.certification
    )
