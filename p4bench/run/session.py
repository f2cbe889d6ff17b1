"""What `p4bench.run.runner.run` keeps while a run trains, besides the observation hooks:
the harness's per-round metrics, the stop rule (time budget, stop request), checkpoints,
and what a resumed run carries over from its checkpoint."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p4bench.config import RunConfig
from p4bench.records import RoundReport, RunInfo, extra_metric_name
from p4bench.run import interrupts
from p4bench.run.checkpoint import Checkpoint, RunCheckpointer, decode_into, restore
from p4bench.run.checkpoint import remove as remove_checkpoint
from p4bench.run.summary import DetectionScore, reported_mean

__all__ = ["RunSession", "mark_interrupted"]


def mark_interrupted(observers: Sequence[object], info: RunInfo) -> None:
    """Tell observers that know about interruptions (the tracker: MLflow status KILLED)."""
    for observer in observers:
        hook = getattr(observer, "run_interrupted", None)
        if hook is not None:
            hook(run=info)


class RunSession:
    """What `run` keeps besides the hooks: per-round metrics of the harness, the stop
    rule (time budget, stop request), checkpoints, and what a resumed run carries over."""

    def __init__(
        self, prepared: Any, requested: RunConfig, resume: Checkpoint | None, tracker: Any
    ) -> None:
        # prepared: a p4bench.run.runner.PreparedRun (not imported: runner imports this module)
        from p4bench.engine.driver import TimeBudget
        from p4bench.engine.runtime import GroupedRuntime
        from p4bench.version import __version__

        self.prepared, self.info = prepared, prepared.info
        job = prepared.job
        self.detection = (
            DetectionScore(self.info.malicious)
            if job.defense is not None and job.defense.filters
            else None
        )
        self.state = resume.state() if resume is not None else None
        self.elapsed_before = float(self.state["elapsed_s"]) if self.state is not None else 0.0
        self.started = time.perf_counter()
        minutes = prepared.config.time_budget_min
        self.budget = TimeBudget(minutes) if minutes is not None else None
        if self.budget is not None:
            self.budget.started -= (
                self.elapsed_before
            )  # the budget counts the rounds before the interruption too
        self.stopped_by_request = False
        # its MLflow run id is read at the first checkpoint: the tracking worker may still be creating it
        self.tracker = tracker
        mlflow_run_id = resume.meta.get("mlflow_run_id") if resume else None
        meta = {
            "config": requested.to_dict(),
            "config_hash": self.info.config_hash or requested.config_hash(),
            "run_id": self.info.run_id,
            "mlflow_run_id": mlflow_run_id,
            "tracking_uri": getattr(tracker, "uri", None),
            "tags": dict(getattr(tracker, "extra_tags", {}) or {}),
            "method": requested.method,
            "rounds": int(self.info.phases[-1].rounds) if self.info.phases else 0,
            "secret_randomness": prepared.config.noise_source == "secure",
            "p4bench_version": __version__,
        }
        self.checkpoints = RunCheckpointer(meta, prepared.ledger)
        folder = getattr(tracker, "local_dir", None)
        self.checkpoints.folder = Path(folder) if folder is not None else None
        self.runtime = prepared.runtime if isinstance(prepared.runtime, GroupedRuntime) else None
        if (
            self.runtime is not None
        ):  # other runtimes (devices) keep their own stop rule and take no checkpoints
            self.runtime.stop_after = self.stop_after
            self.runtime.prepare_driver = self._restore if self.state is not None else None

    def _restore(self, driver: Any) -> None:
        assert self.state is not None  # set on resume
        restore(driver, self.prepared.ledger, self.state)
        if self.detection is not None:
            self.detection.totals = np.asarray(
                decode_into(None, self.state["detection"]), dtype=np.int64
            )
        self.checkpoints.written_step = driver.reports[-1].step if driver.reports else 0

    def stop_after(self, step: int) -> bool:
        if self.prepared.stop_at_step is not None and step >= self.prepared.stop_at_step:
            return True
        if self.budget is not None and self.budget(step):
            return True
        if interrupts.stop_requested():
            self.stopped_by_request = True
            return True
        return False

    @property
    def driver(self) -> Any:
        return getattr(self.runtime, "driver", None)

    @property
    def complete(self) -> bool:
        return self.driver is None or self.driver.complete

    def add_round_metrics(self, report: RoundReport) -> None:
        """The harness's figures of a round, before the observers see it."""
        info = self.info
        report.metrics["accuracy_mean"] = reported_mean(report.accuracy, info.reported)
        aggregator = getattr(self.prepared.runtime, "aggregator", None)
        if self.detection is not None and aggregator is not None:
            report.metrics.update(self.detection.score(aggregator.log))
        report.metrics.update(self.prepared.job.method.derived_metrics(report.metrics))
        for name, values in report.extra_accuracy.items():
            report.metrics[extra_metric_name(name)] = reported_mean(values, info.reported)
        if report.client_bytes_sent is not None:
            report.metrics["client_bytes_sent_mean"] = float(report.client_bytes_sent.mean())
            report.metrics["client_bytes_sent_max"] = float(report.client_bytes_sent.max())
            assert (
                report.client_bytes_received is not None
            )  # reported together with client_bytes_sent
            report.metrics["client_bytes_received_mean"] = float(
                report.client_bytes_received.mean()
            )

    def checkpoint(self, force: bool = False) -> None:
        """Checkpoint the driver after a round (if due, or `force`)."""
        driver = self.driver
        if driver is None or self.checkpoints.folder is None:
            return
        if self.detection is not None:
            self.detection.seen = len(driver.aggregator.log)
        if self.checkpoints.meta.get("mlflow_run_id") is None:
            self.checkpoints.meta["mlflow_run_id"] = getattr(self.tracker, "mlflow_run_id", None)
        elapsed = self.elapsed_before + time.perf_counter() - self.started
        totals = (
            self.detection.totals if self.detection is not None else np.zeros(4, dtype=np.int64)
        )
        self.checkpoints.after_round(
            driver, {"elapsed_s": elapsed, "detection": totals}, force=force
        )

    def where(self) -> str:
        """How far the run got, in the user's terms."""
        driver = self.driver
        reports = driver.reports if driver is not None else []
        if not reports:
            return "before the first round finished"
        last_phase = self.info.phases[-1]
        done = sum(1 for r in reports if r.phase == last_phase.name)
        if reports[-1].phase != last_phase.name:
            return f"in phase '{reports[-1].phase}' before round 1 of {last_phase.rounds}"
        return f"after round {done} of {last_phase.rounds}"

    def interrupted(self, observers: Sequence[object]) -> interrupts.RunInterrupted:
        """Checkpoint the last round (if not yet), mark the run interrupted; the exception to raise."""
        self.checkpoint(force=True)
        mark_interrupted(observers, self.info)
        folder = self.checkpoints.folder
        unsaved = self.checkpoints.unsaved
        why_not = (
            f" (state a checkpoint cannot hold: {', '.join(unsaved[:3])}{', ...' if len(unsaved) > 3 else ''})"
            if unsaved
            else ""
        )
        return interrupts.RunInterrupted(
            self.where(),
            folder,
            self.checkpoints.written_step > 0,
            self.checkpoints.meta.get("mlflow_run_id")
            or getattr(self.tracker, "mlflow_run_id", None),
            why_not,
        )

    def finished(self) -> None:
        """The run is complete: its checkpoint is no longer needed."""
        if self.checkpoints.folder is not None:
            remove_checkpoint(self.checkpoints.folder)
