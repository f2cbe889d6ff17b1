"""One run of a sweep, wherever it executes (`p4bench.studies.backends`): the picklable
`RunTask`, `execute_task` (resuming from a checkpoint, settling an earlier attempt, never
raising for a failing run) and the small `RunRecord` it returns, with the observers that
fill it (`RoundRecorder`) and that withhold the reported clients' test data from a tuning
run (`WithheldTests`)."""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from p4bench.config import RunConfig
from p4bench.hookspecs import hookimpl
from p4bench.studies.results import TUNING_TAG
from p4bench.tracking.participation import COUNT_PREFIX

if TYPE_CHECKING:
    import pluggy

    from p4bench.records import RoundReport, RunInfo, RunResult

__all__ = ["RoundRecorder", "RunRecord", "RunTask", "WithheldTests", "error_line", "execute_task"]


@dataclass(frozen=True)
class RunTask:
    """One run to execute: its config (as plain values, so it pickles), extra MLflow tags,
    and whether it is a tuning run (test splits of all but the benign evaluation clients
    are withheld before round one; see p4bench.studies.tune)."""

    config: Mapping[str, Any]
    tags: Mapping[str, str] = field(default_factory=dict)
    tuning: bool = False
    track: bool = True
    autoload: bool | None = None  # third-party plugin autoload in workers (None: environment)
    # MLflow tags saying where the run executed (the Ray node): logged, but not part of the
    # run's identity, so a checkpoint made on one node is found by an attempt on another
    placement: Mapping[str, str] = field(default_factory=dict)

    def run_config(self) -> RunConfig:
        return RunConfig(**dict(self.config))


@dataclass
class RunRecord:
    """What the sweep keeps of one run (small and picklable)."""

    config_hash: str
    status: str  # finished | failed | skipped | incompatible | interrupted (Ctrl-C: resumed by the next sweep)
    summary: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, float]] = field(default_factory=list)  # per round: step, accuracy means
    evaluation_accuracy: float | None = None  # final mean over benign evaluation clients
    error: str | None = None
    traceback: str | None = None
    seconds: float = 0.0
    mlflow_run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


# -- observers --------------------------------------------------------------------------


class RoundRecorder:
    """Adds the evaluation clients' mean accuracy to every round's metrics (before the
    tracker logs them) and keeps each round's means for the record."""

    def __init__(self, resume: Any = None) -> None:
        self.rounds: list[dict[str, float]] = []
        self.selection: np.ndarray | None = None
        if (
            resume is not None
        ):  # a resumed run: the rounds before its checkpoint, from the reports saved there
            from p4bench.run.checkpoint import unpack_report

            for report in map(unpack_report, resume.state()["reports"]):
                self.rounds.append(
                    {
                        "step": report.step,
                        **{
                            k: float(report.metrics.get(k, math.nan))
                            for k in ("accuracy_mean", "accuracy_evaluation_mean")
                        },
                    }
                )

    @hookimpl(tryfirst=True)
    def run_started(self, run: RunInfo) -> None:
        self.selection = run.evaluation & ~run.malicious

    @hookimpl(tryfirst=True)
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        chosen = report.accuracy[self.selection]
        value = float(chosen.mean()) if len(chosen) else float("nan")
        report.metrics["accuracy_evaluation_mean"] = value
        self.rounds.append(
            {
                "step": report.step,
                "accuracy_mean": float(report.metrics.get("accuracy_mean", math.nan)),
                "accuracy_evaluation_mean": value,
            }
        )


class WithheldTests:
    """Tuning runs: before round one, empty the test split of every client that is not a
    benign evaluation client, so that no model is ever evaluated on (or otherwise reads) a
    reported client's test data. Their accuracies become unavailable (NaN), not zero."""

    def __init__(self) -> None:
        self.withheld: np.ndarray | None = None

    @hookimpl(tryfirst=True)
    def run_started(self, run: RunInfo) -> None:
        import torch

        if run.data is None:  # never train on tests that should have been withheld
            raise RuntimeError(
                "withholding the reported clients' tests needs the run's data in this process"
            )
        test = run.data.test  # the very tensors the runtime reads when the rounds start
        drop = torch.from_numpy(~(run.evaluation & ~run.malicious))
        test.x[drop.to(test.x.device)] = 0
        test.y[drop.to(test.y.device)] = 0
        test.n[drop.to(test.n.device)] = 0
        self.withheld = drop.numpy().copy()

    @staticmethod
    def _over_reported(key: str) -> bool:
        return (
            key.startswith("accuracy_")
            and key != "accuracy_evaluation_mean"
            and key != "accuracy_per_client"
        )

    @hookimpl(tryfirst=True)
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        for key in [k for k in report.metrics if self._over_reported(k)]:
            report.metrics[key] = math.nan  # reported clients were not evaluated
        # nor are their per-client figures (an empty test split scores 0): the participation
        # curve, the per-client logs; counts (`count_*`) are not test figures and stay
        report.accuracy[self.withheld] = math.nan
        for name, values in report.extra_accuracy.items():
            if not name.startswith(COUNT_PREFIX) and np.issubdtype(values.dtype, np.floating):
                values[self.withheld] = math.nan

    @hookimpl(tryfirst=True)
    def run_finished(self, run: RunInfo, result: RunResult) -> None:
        result.outcome.accuracy[self.withheld] = math.nan
        for name, values in result.outcome.extra_accuracy.items():
            if not name.startswith(COUNT_PREFIX):
                values[self.withheld] = math.nan
        result.summary = result.summary.without_reported_accuracy()


@lru_cache(maxsize=2)
def _plugin_manager(autoload: bool | None) -> pluggy.PluginManager:
    from p4bench.host.manager import create_plugin_manager, default_plugin_manager

    return (
        default_plugin_manager() if autoload is None else create_plugin_manager(autoload=autoload)
    )


def execute_task(task: RunTask, plugin_manager: Any = None) -> RunRecord:
    """Run one task and return its record; never raises for a failing run. A run with a
    checkpoint (interrupted in an earlier sweep) goes on from it; a run stopped by Ctrl-C
    (`p4bench.run.interrupts`) is recorded as interrupted, with its checkpoint."""
    from p4bench.run import interrupts, runner
    from p4bench.run.checkpoint import find_for_config
    from p4bench.studies.attempts import (
        PLANNED_RUN_TAG,
        finished_summary,
        planned_run_key,
        record_failure,
        run_row,
        settle_attempts,
    )
    from p4bench.tracking.stores import default_tracking_uri
    from p4bench.tracking.tracker import Tracker

    started = time.perf_counter()
    tags = {**task.tags, TUNING_TAG: "true" if task.tuning else "false"}
    try:
        config = task.run_config()
    except Exception as exc:  # noqa: BLE001 - reported in the record
        return RunRecord(
            "", "failed", error=error_line(exc), traceback=traceback.format_exc(), tags=tags
        )
    if interrupts.stop_requested():  # Ctrl-C before this run started: leave it to the next sweep
        return RunRecord(config.config_hash(), "interrupted", error="not started", tags=tags)
    tracker = checkpoint = None
    try:
        checkpoint = (
            find_for_config(config.results_dir, config.config_hash(), tags) if task.track else None
        )
        if task.track:  # an earlier attempt of this sweep run (a lost worker, a retried task): see tracking_attempts
            uri = config.tracking_uri or default_tracking_uri(config.results_dir)
            done = settle_attempts(
                uri, config, tags, keep=checkpoint.meta.get("mlflow_run_id") if checkpoint else None
            )
            if (
                done is not None
            ):  # it finished, but its answer never reached the sweep: not trained again
                summary, evaluation = finished_summary(config, run_row(done))
                return RunRecord(
                    config.config_hash(),
                    "skipped",
                    summary=summary,
                    evaluation_accuracy=evaluation,
                    mlflow_run_id=done.info.run_id,
                    tags=tags,
                )
        recorder = RoundRecorder(checkpoint)
        placement = {**task.placement, PLANNED_RUN_TAG: planned_run_key(tags)}
        tracker = (
            Tracker(config, tags=tags, resume=checkpoint, placement=placement)
            if task.track
            else None
        )
        observers: list[object] = [o for o in (tracker, recorder) if o is not None]
        if task.tuning:
            observers.append(WithheldTests())
        pm = plugin_manager or _plugin_manager(task.autoload)
        result = runner.run(
            config, observers=observers, plugin_manager=pm, track=False, resume=checkpoint
        )
    except interrupts.RunInterrupted as stopped:
        return RunRecord(
            config.config_hash(),
            "interrupted",
            error=stopped.line(),
            seconds=time.perf_counter() - started,
            mlflow_run_id=stopped.mlflow_run_id,
            tags=tags,
            summary={"results_dir": str(stopped.results_dir) if stopped.results_dir else None},
        )
    except Exception as exc:  # noqa: BLE001 - one failing run must not stop a sweep
        record = RunRecord(
            config.config_hash(),
            "failed",
            error=error_line(exc),
            traceback=traceback.format_exc(),
            seconds=time.perf_counter() - started,
            tags=tags,
        )
        record.mlflow_run_id = record_failure(config, tracker, tags, record.error)
        if (
            checkpoint is not None
        ):  # the next sweep starts this run afresh rather than fail on the same checkpoint
            from p4bench.run.checkpoint import remove

            remove(checkpoint.folder)
        return record
    summary = _plain(result.summary)
    final = recorder.rounds[-1]["accuracy_evaluation_mean"] if recorder.rounds else math.nan
    return RunRecord(
        config_hash=config.config_hash(),
        status="finished",
        summary=summary,
        rounds=recorder.rounds,
        evaluation_accuracy=final,
        seconds=time.perf_counter() - started,
        mlflow_run_id=summary.get("run_id") if summary.get("tracked") else None,
        tags=tags,
    )


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the start of its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _plain(value: Any) -> Any:
    """JSON-like copy (numpy scalars to Python) so records pickle and print cleanly."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
