"""MLflow tracking plus a local copy of every run's results.

The tracker is an observer plugin. Every round is appended to the local folder before
it is sent to MLflow, so a crash or an unreachable tracking server never loses results;
if MLflow fails, the run finishes and says where the local copy is.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from p4bench.config import RunConfig
from p4bench.hookspecs import hookimpl
from p4bench.records import RoundReport, RunInfo, RunResult, display_round
from p4bench.run.artifacts import final_metrics, final_tags, plot_accuracy, write_partition_summary
from p4bench.tracking.ops import dataset_spec
from p4bench.tracking.participation import participation_curve, write_participation_curve
from p4bench.tracking.stores import (  # defined there, used here
    _server_reachable,
    default_tracking_uri,
)

log = logging.getLogger(__name__)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_name(config: RunConfig, defense: str | None) -> str:
    """The MLflow run name `method-attack-defense-dataset-seed` (`none` for no attack or
    defense), e.g. `p4-none-p4-secure-digits-0`: attacked and clean runs differ by name."""
    return f"{config.method}-{config.attack or 'none'}-{defense or 'none'}-{config.dataset}-{config.seed}"


def dataset_input(config: RunConfig, run: Any) -> dict[str, str]:
    """The run's data as an MLflow dataset input (the runs table's Dataset column), in plain
    values: the dataset, how it was partitioned, and its size; the digest names the partition
    (same dataset, partitioner, clients and seed: same digest)."""
    data = getattr(run, "data", None)
    loaded = getattr(run, "plugins", {}).get("dataset", {}).get("data")  # e.g. the mnist subset
    profile: dict[str, Any] = {
        "clients": config.clients,
        "partitioner": config.partitioner,
        "seed": config.seed,
    }
    if data is not None:
        profile.update(
            train_records=int(data.train.n.sum()),
            test_records=int(data.test.n.sum()),
            classes=int(data.num_classes),
        )
    key = json.dumps(
        {
            k: getattr(config, k)
            for k in (
                "dataset",
                "partitioner",
                "similarity",
                "clients",
                "samples_per_client",
                "seed",
                "features",
                "eval_set",
            )
        },
        sort_keys=True,
        default=str,
    )
    source = (
        f"{loaded or config.dataset}, {config.partitioner} over {config.clients} clients "
        f"(seed {config.seed})"
    )
    digest = hashlib.sha256((key + (loaded or "")).encode()).hexdigest()[:8]
    return dataset_spec(config.dataset, digest, source, profile)


def flat_params(
    config: RunConfig,
    plugin_options: Mapping[str, Mapping[str, Any]] | None = None,
    defense: str | None = None,
) -> dict[str, str]:
    """The config as MLflow params: fields, `options.<key>` as given, and `option.<key>`
    for every used plugin's resolved option (defaults included). `defense` is the
    resolved defense (the method's default where the config names none)."""
    from p4bench.options import option_params

    params = {
        k: ("none" if v is None else str(v)) for k, v in config.to_dict().items() if k != "options"
    }
    if defense is not None or config.defense is None:
        params["defense"] = defense or "none"
    for key, value in config.options.items():
        params[f"options.{key}"] = json.dumps(value, default=str)
    params.update(option_params(plugin_options or {}))
    return params


class Tracker:
    """Observer that writes `<results_dir>/<run_id>/` and mirrors it to MLflow.

    With `resume` (a checkpoint of an interrupted run) it goes on in that run's folder
    and MLflow run: metric steps continue where the checkpoint left off. MLflow is written
    by the tracking worker `p4bench run` prestarts (`p4bench.tracking.worker`), else in
    this process (`p4bench.tracking.ops.LocalBackend`): the same operations either way."""

    def __init__(
        self,
        config: RunConfig,
        tags: Mapping[str, str] | None = None,
        resume: Any = None,
        placement: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.resume = resume  # p4bench.run.checkpoint.Checkpoint
        self.extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}  # e.g. a sweep's name
        self.placement = dict(
            placement or {}
        )  # where it runs (a Ray node): logged, not kept in checkpoints
        self.uri = config.tracking_uri or default_tracking_uri(config.results_dir)
        self.backend: Any = None  # LocalBackend | WorkerBackend once MLflow is opened
        self._run_reply: Any = None  # the MLflow run id, when the backend has answered
        self._unreachable: str | None = None
        self.local_dir: Path | None = None

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run's id (waits for the worker to create it); None if not tracked."""
        return None if self._run_reply is None else self._run_reply.value()

    @property
    def error(self) -> str | None:
        """The first tracking failure so far, as one line."""
        return self._unreachable or (self.backend.error if self.backend is not None else None)

    def _tracking(self) -> bool:
        """A run was asked for (the backend skips everything after a failure)."""
        return self.backend is not None and self._run_reply is not None

    def _open_backend(self) -> bool:
        """Open MLflow (the prestarted worker, else in this process); False if the server is unreachable."""
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if not _server_reachable(self.uri):
            self._unreachable = f"MLflow tracking server {self.uri} cannot be reached"
            return False
        from p4bench.tracking.ops import LocalBackend
        from p4bench.tracking.worker import take

        self.backend = take(self.uri) or LocalBackend(self.uri)
        return True

    def _start_mlflow(self, run: RunInfo) -> None:
        if not self._open_backend():
            return
        from p4bench.version import __version__

        config = self.config
        loaded = getattr(run, "plugins", {}).get("dataset", {}).get("data")
        tags = {
            **self.extra_tags,
            **self.placement,  # the run's own tags below always win
            "method": config.method,
            "attack": config.attack or "none",
            "defense": run.defense or "none",
            "dataset": config.dataset,
            **({"dataset.data": loaded} if loaded else {}),  # the data that ran: mnist's subset
            "seed": str(config.seed),
            "p4bench_version": __version__,
            "config_hash": run.config_hash or config.config_hash(),
            "local_run_id": run.run_id,
            # which distribution and version provided each plugin, e.g. plugin.method = "p4bench 0.1.0"
            **{
                f"plugin.{kind}": f"{p['distribution']} {p['version']}"
                for kind, p in getattr(run, "plugins", {}).items()
            },
        }
        commit = _git_commit()
        if commit:
            tags["git_commit"] = commit
        if run.certification is not None:  # known before training: a crashed run still says it
            tags.update(run.certification.tags())
        if getattr(
            run, "public_data", None
        ):  # threat model: data the method reads besides the clients'
            tags["threat.public_data"] = str(run.public_data)
        if self.local_dir is not None:
            tags["results_dir"] = str(
                self.local_dir.resolve()
            )  # `p4bench run --resume <MLflow run id>` finds it
        params = flat_params(config, getattr(run, "plugin_options", None), run.defense)
        self._run_reply = self.backend.ask(
            "create run",
            "start_run",
            config.experiment,
            tags,
            run_name(config, run.defense),
            params,
            dataset_input(config, run),
        )

    def _reopen_mlflow(self, run_id: str | None) -> None:
        """Go on logging into the interrupted run's MLflow run (status RUNNING again)."""
        if run_id is None or not self._open_backend():
            return
        tags = {"resumed_from_step": str(self.resume.meta.get("step", 0)), **self.placement}
        self._run_reply = self.backend.ask("reopen run", "reopen_run", run_id, tags)

    def _resume_local(self) -> None:
        """The interrupted run's folder, its metrics.csv cut back to the checkpoint's rounds
        (a round logged after the last checkpoint is run again)."""
        self.local_dir = Path(self.resume.folder)
        metrics = self.local_dir / "metrics.csv"
        step = int(self.resume.meta.get("step", 0))
        if metrics.is_file():
            with open(metrics, newline="") as handle:
                rows = list(csv.reader(handle))
            kept = rows[:1] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
            with open(metrics, "w", newline="") as handle:
                csv.writer(handle).writerows(kept)

    def run_interrupted(self, run: RunInfo) -> None:
        """Called by the runner (not a hook of the spec) when a run stops before its end
        (Ctrl-C): the MLflow run becomes KILLED; the local folder keeps the checkpoint."""
        if self._tracking():
            self.backend.call("finish run", "terminate", "KILLED")
        if self.backend is not None:
            self.backend.close()

    # -- observation hooks ------------------------------------------------------------
    @hookimpl
    def run_started(self, run: RunInfo) -> None:
        if self.resume is not None:
            self._resume_local()
            self._reopen_mlflow(self.resume.meta.get("mlflow_run_id"))
            return
        self.local_dir = (
            Path(self.config.results_dir)
            / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.config.method}-{run.run_id}"
        )
        self.local_dir.mkdir(parents=True, exist_ok=True)
        (self.local_dir / "config.yaml").write_text(
            yaml.safe_dump(self.config.to_dict(), sort_keys=False)
        )
        with open(self.local_dir / "metrics.csv", "w", newline="") as handle:
            csv.writer(handle).writerow(
                ["step", "phase", "round", "accuracy_mean", "train_loss", "seconds", "bytes_sent"]
            )
        if run.data is not None:
            write_partition_summary(
                run, self.local_dir, heatmap=False
            )  # partition.png in run_finished: matplotlib is ~0.5 s
        report = getattr(run, "partition_report", None)
        for name, text in report.artifacts.items() if report is not None else ():
            (self.local_dir / name).write_text(text)
        self._start_mlflow(run)
        if report is not None and report.stats:
            stamp = int(time.time() * 1000)
            rows = [
                (f"partition.{k}", float(v), stamp, 0)
                for k, v in report.stats.items()
                if np.isfinite(v)
            ]
            self._log_metrics("log partition metrics", rows)

    def _log_metrics(self, action: str, rows: list[tuple[str, float, int, int]]) -> None:
        """Rows of (key, value, timestamp, step), written without waiting."""
        if self._tracking():
            self.backend.call(action, "log_metrics", rows)

    @hookimpl
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        mean = report.metrics.get("accuracy_mean", float("nan"))
        assert self.local_dir is not None  # set by run_started
        with open(self.local_dir / "metrics.csv", "a", newline="") as handle:
            csv.writer(handle).writerow(
                [
                    report.step,
                    report.phase,
                    report.round,
                    mean,
                    report.train_loss,
                    report.seconds,
                    report.bytes_sent,
                ]
            )
        if not self._tracking():
            return
        stamp = int(time.time() * 1000)
        values = {
            "accuracy_mean": mean,
            "train_loss": report.train_loss,
            "round_seconds": report.seconds,
            "bytes_sent": float(report.bytes_sent),
        }
        values.update({k: v for k, v in report.metrics.items() if k != "accuracy_mean"})
        step = display_round(
            run.phases, report.phase, report.round
        )  # P4's co-training rounds are 1..T too
        self._log_metrics(
            "log metrics", [(k, float(v), stamp, step) for k, v in values.items() if np.isfinite(v)]
        )

    @hookimpl
    def run_finished(self, run: RunInfo, result: RunResult) -> None:
        folder = self.local_dir
        assert folder is not None  # set by run_started
        if run.data is not None:
            write_partition_summary(run, folder, table=False)
        self._write_clients(run, result, folder / "clients.csv")
        plot_accuracy(
            folder / "metrics.csv",
            folder / "accuracy.png",
            title=f"{self.config.method} on {self.config.dataset}",
        )
        summary = dict(result.summary)
        summary["results_dir"] = str(folder)
        extra = [p.name for p in result.write_method_artifacts(folder)]
        curve = participation_curve(
            result.outcome.reports, run.reported
        )  # methods that report a count_* value
        extra += [
            p.name
            for p in write_participation_curve(
                curve, folder, f"{self.config.method}: metrics by participation count"
            )
        ]
        if self._tracking():
            report = getattr(run, "partition_report", None)
            partition_files = list(report.artifacts) if report is not None else []
            names = [
                "config.yaml",
                "clients.csv",
                "metrics.csv",
                "accuracy.png",
                "partition.csv",
                "partition.png",
                *partition_files,
                *extra,
            ]
            self.backend.call(
                "log artifact",
                "log_artifacts",
                [str(folder / n) for n in names if (folder / n).exists()],
            )
            self.backend.call("tag run", "set_tags", final_tags(result.summary))
            stamp = int(time.time() * 1000)
            final = final_metrics(result)
            self._log_metrics(
                "log final metrics", [(k, v, stamp, 0) for k, v in final.items() if np.isfinite(v)]
            )
            if curve:  # step = participation count r: MLflow plots the paper's x-axis directly
                by_r = [
                    (f"by_participation.{key}", row[key], stamp, int(row["r"]))
                    for row in curve
                    for key in ("accuracy", "loss", "auc", "peers")
                    if np.isfinite(row[key])
                ]
                self._log_metrics("log participation curve", by_r)
            self.backend.call("finish run", "terminate", "FINISHED")
        if self.backend is not None:
            self.backend.close()  # waits until the worker has written everything
        tracked = self.error is None and self.mlflow_run_id is not None
        run.tracking.update(
            {
                "run_id": self.mlflow_run_id if tracked else run.run_id,
                "tracking_uri": self.uri,
                "tracked": tracked,
                "tracking_error": self.error,
                "results_dir": str(folder),
            }
        )
        (folder / "summary.json").write_text(json.dumps({**summary, **run.tracking}, indent=2))

    @staticmethod
    def _write_clients(run: RunInfo, result: RunResult, path: Path) -> None:
        outcome = result.outcome
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["client", "role", "malicious", "accuracy"])
            for client, acc in enumerate(outcome.accuracy):
                role = "evaluation" if run.evaluation[client] else "reported"
                writer.writerow([client, role, bool(run.malicious[client]), float(acc)])
