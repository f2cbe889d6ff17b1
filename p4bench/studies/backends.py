"""Where the runs of a sweep execute: in this process, in worker processes, or on a Ray cluster.

Every backend calls the same `execute_task` on a picklable `RunTask` and gets back a small
`RunRecord`, so a run's numbers do not depend on where it ran: every random stream derives
from the run's seed (see p4bench.rng), never from the process. Workers build their own
plugin manager; plugins must therefore be installed (entry points), not registered by hand
in the parent process, to be used with `--jobs` or Ray.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from p4bench.errors import UsageError
from p4bench.studies.run_task import (
    RoundRecorder,
    RunRecord,
    RunTask,
    WithheldTests,
    error_line,
    execute_task,
)

__all__ = [  # a run's task, record and execution are re-exported: `p4bench.studies.run_task`
    "RunTask",
    "RunRecord",
    "RoundRecorder",
    "WithheldTests",
    "execute_task",
    "execute_on_ray_node",
    "Backend",
    "LocalBackend",
    "RayBackend",
    "make_backend",
]

OnDone = Callable[[int, "RunRecord"], None]


# -- backends ---------------------------------------------------------------------------


class Backend:
    """Executes tasks, calling `on_done(index, record)` as each one ends (any order)."""

    name = "backend"

    def map(
        self, tasks: Sequence[RunTask], on_done: OnDone
    ) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class LocalBackend(Backend):
    """In this process (jobs=1), or in `jobs` spawned worker processes."""

    name = "local"

    def __init__(self, jobs: int = 1, plugin_manager: Any = None) -> None:
        if jobs < 1:
            raise UsageError(f"--jobs must be at least 1, got {jobs}")
        self.jobs, self.plugin_manager = jobs, plugin_manager

    def describe(self) -> str:
        return "in this process" if self.jobs == 1 else f"{self.jobs} worker processes"

    def map(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        if self.jobs == 1:
            from p4bench.host.manager import default_plugin_manager

            pm = self.plugin_manager or default_plugin_manager()  # the CLI's own plugins
            for index, task in enumerate(tasks):
                on_done(index, execute_task(task, pm))  # after a Ctrl-C: "interrupted", not started
            return
        import multiprocessing
        from concurrent.futures import CancelledError, ProcessPoolExecutor, as_completed

        from p4bench.run.interrupts import stop_requested
        from p4bench.run.threads import share_of

        threads = share_of(self.jobs)  # several workers share the machine's cores
        with ProcessPoolExecutor(
            self.jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(threads,),
        ) as pool:
            futures = {pool.submit(execute_task, task): index for index, task in enumerate(tasks)}
            for future in as_completed(futures):
                index = futures[future]
                if (
                    stop_requested()
                ):  # Ctrl-C: workers stop their runs after the round; queued runs do not start
                    for waiting in futures:
                        waiting.cancel()
                try:
                    record = future.result()
                except CancelledError:
                    record = _not_started(tasks[index])
                except Exception as exc:  # noqa: BLE001 - a worker that died
                    record = _lost(tasks[index], exc)
                on_done(index, record)


def _init_worker(threads: int) -> None:
    from p4bench.run.interrupts import install_in_worker
    from p4bench.run.threads import set_process_share

    set_process_share(threads)  # each run in this worker takes this share (`p4bench.run.threads`)
    install_in_worker()  # the terminal's Ctrl-C reaches workers too: finish the round, checkpoint


def _not_started(task: RunTask) -> RunRecord:
    try:
        config_hash = task.run_config().config_hash()
    except Exception:  # noqa: BLE001
        config_hash = ""
    return RunRecord(config_hash, "interrupted", error="not started", tags=dict(task.tags))


def _lost(task: RunTask, exc: BaseException) -> RunRecord:
    try:
        config_hash = task.run_config().config_hash()
    except Exception:  # noqa: BLE001
        config_hash = ""
    return RunRecord(
        config_hash, "failed", error=f"worker lost: {error_line(exc)}", tags=dict(task.tags)
    )


class RayBackend(Backend):
    """One Ray task per run on a cluster (`address`, see `p4bench.studies.ray_cluster`), or on a
    local Ray instance; a Ray instance that is already initialised in this process is reused.

    A task whose worker process or node dies is run again by Ray, up to `retries` times, on
    a node that is alive (the run's earlier attempt is superseded in MLflow, see
    `p4bench.studies.attempts`); a run that fails in Python is never retried (its task
    returns a failed record). Every run is tagged with the node it ran on (`ray_node_id`)."""

    name = "ray"

    def __init__(
        self, address: str | None = None, cpus_per_run: float = 1.0, retries: int = 2
    ) -> None:
        self.address, self.cpus_per_run, self.retries = address, cpus_per_run, retries

    def describe(self) -> str:
        return f"Ray at {self.address}" if self.address else "a local Ray instance"

    def map(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        try:
            import ray
        except ImportError:
            raise UsageError("the ray backend needs Ray: pip install 'p4bench[ray]'") from None
        from p4bench.studies.ray_cluster import connect

        started_here = not ray.is_initialized()
        if started_here:
            connect(ray, self.address, _forwarded_environment())
        try:
            remote = ray.remote(num_cpus=self.cpus_per_run, max_retries=self.retries)(
                execute_on_ray_node
            )
            pending = {remote.remote(task): index for index, task in enumerate(tasks)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(done[0])
                try:
                    record = ray.get(done[0])
                except Exception as exc:  # noqa: BLE001 - a worker or node that died, retries spent
                    record = _lost(tasks[index], exc)
                on_done(index, record)
        finally:
            if started_here:
                ray.shutdown()


def execute_on_ray_node(task: RunTask) -> RunRecord:
    """`execute_task` inside a Ray worker, tagging the run with the node it runs on."""
    from p4bench.studies.ray_cluster import NODE_TAG, node_id

    node = node_id()
    return execute_task(
        replace(task, placement={**task.placement, NODE_TAG: node}) if node else task
    )


def _forwarded_environment() -> dict[str, str]:
    """Settings the workers need to find the same data and store as this process."""
    keys = (
        "P4BENCH_DATA_DIR",
        "P4BENCH_CACHE_DIR",
        "P4BENCH_DISABLE_PLUGIN_AUTOLOAD",
        "MLFLOW_TRACKING_URI",
    )
    return {k: os.environ[k] for k in keys if os.environ.get(k)}


def make_backend(name: str, jobs: int = 1, address: str | None = None) -> Backend:
    """The backend a CLI user names: `local` (with --jobs) or `ray` (with --address)."""
    if name == "local":
        if address:
            raise UsageError("--address is only used with --backend ray")
        return LocalBackend(jobs)
    if name == "ray":
        from p4bench.studies.ray_cluster import check_reachable

        check_reachable(address)  # before any planning or tuning: one line and exit 2
        return RayBackend(address)
    raise UsageError(f"unknown backend '{name}'; choose local or ray")
