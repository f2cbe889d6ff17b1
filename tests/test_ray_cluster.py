"""Scale-out on a real Ray cluster with a shared MLflow tracking server, all on 127.0.0.1.

A head and a worker node (`ray start --head`, `ray start --address`, one CPU each, their
own temp folders) and an `mlflow server` (SQLite backend store, an artifact store) run as
separate process sessions; sweeps go through the command line with `--backend ray
--address ... --tracking-uri http://...`, as a user would run them. Checked against the
server: every grid point has exactly one FINISHED run, the runs executed on both nodes,
and after the worker node is killed in the middle of a run the sweep still lands every
point once (Ray runs the lost task again on the head; the lost attempt is superseded),
and running the sweep again trains nothing.

The cluster uses token authentication with a token made for the test (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN), so it neither depends on nor touches `~/.ray/auth_token`; every Ray server
listens on 127.0.0.1 only (see LOOPBACK_ONLY). Processes are stopped by their session id,
never with `ray stop` (which stops every Ray process of the machine).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'p4bench[ray]'")
if not Path("/proc/self/stat").exists():
    pytest.skip(
        "stopping the test's Ray processes by session needs /proc (Linux)", allow_module_level=True
    )

from mlflow.entities import ViewType  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

BIN = Path(sys.executable).parent
# Ray 2.60 replaces a loopback node address with the machine's and then listens on every
# interface; its servers listen on 127.0.0.1 alone when the node address is 127.0.0.1. This
# setting (named for single-machine Ray on macOS/Windows) keeps the head and the drivers on
# 127.0.0.1, but `ray start --address` refuses to add a node under it: the worker node is
# `ray start` with Ray's loopback rewrite turned off instead.
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
JOIN_ON_LOOPBACK = (
    "import sys, ray._private.services as services; services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)
STARTUP_S = 120  # the MLflow server alone takes ~30 s on a loaded 2-core machine
SWEEP_S = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _session_pids(sid: int) -> list[int]:
    """Every process of the session `sid` (a node's `ray start`, its raylet, workers, agents)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


@dataclass
class Service:
    """A process started in a session of its own, stopped with everything it started."""

    name: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        for pid in _session_pids(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _start(name: str, argv: list[str], env: dict[str, str], folder: Path) -> Service:
    log = folder / f"{name}.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(
            argv, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Service(name, process, log)


def _wait(what: str, ready, services: list[Service], seconds: float = STARTUP_S) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [s for s in services if s.process.poll() is not None]
        if dead:
            pytest.fail(
                f"{dead[0].name} exited while waiting for {what}:\n{dead[0].log.read_text()[-3000:]}"
            )
        time.sleep(0.5)
    pytest.fail(f"{what} not ready within {seconds} s")


def _node_id(temp_dir: Path) -> str:
    """The node id of the raylet whose temp folder is `temp_dir` (from its log)."""
    for log in sorted(temp_dir.glob("session_*/logs/raylet.out")):
        found = re.search(r"node_id=([0-9a-f]{56})", log.read_text())
        if found:
            return found.group(1)
    raise AssertionError(f"no raylet node id under {temp_dir}")


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    address: str
    tracking_uri: str
    head: Service
    worker: Service
    worker_dir: Path

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri)

    def sweep_argv(self, spec: Path) -> list[str]:
        return [
            str(BIN / "p4bench"),
            "sweep",
            str(spec),
            "--backend",
            "ray",
            "--address",
            self.address,
            "--tracking-uri",
            self.tracking_uri,
            "--results-dir",
            str(self.root / "runs"),
        ]

    def sweep(self, spec: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.sweep_argv(spec), env=self.env, capture_output=True, text=True, timeout=SWEEP_S
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # a short folder: Ray's Unix sockets live under --temp-dir and their paths are limited to ~100 characters
    root = Path(tempfile.mkdtemp(prefix="p4ray-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update(
        {LOOPBACK_ONLY: "0"},
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_USAGE_STATS_ENABLED="0",
        # a dead node is noticed in seconds, not the default half minute
        RAY_health_check_period_ms="1000",
        RAY_health_check_timeout_ms="1000",
        RAY_health_check_failure_threshold="3",
    )
    ray_port, ml_port = _free_port(), _free_port()
    services: list[Service] = []
    try:
        services.append(
            _start(
                "mlflow",
                [
                    str(BIN / "mlflow"),
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{root}/mlflow.db",
                    "--artifacts-destination",
                    str(root / "artifacts"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(ml_port),
                    "--workers",
                    "1",
                ],
                env,
                root,
            )
        )
        node = [
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            "1",
            "--disable-usage-stats",
            "--block",
        ]
        head = _start(
            "ray-head",
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--port",
                str(ray_port),
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(root / "head"),
                *node,
            ],
            env,
            root,
        )
        services.append(head)
        _wait("the Ray head", lambda: _answers(ray_port), services)
        joining = {
            k: v for k, v in env.items() if k != LOOPBACK_ONLY
        }  # Ray refuses to join a node in that mode
        worker = _start(
            "ray-worker",
            [
                sys.executable,
                "-c",
                JOIN_ON_LOOPBACK,
                "start",
                "--address",
                f"127.0.0.1:{ray_port}",
                "--temp-dir",
                str(root / "worker"),
                *node,
            ],
            joining,
            root,
        )
        services.append(worker)
        _wait(
            "the Ray worker node", lambda: "Ray runtime started" in worker.log.read_text(), services
        )
        _wait("the MLflow server", lambda: _answers(ml_port), services)
        yield Cluster(
            root,
            env,
            f"127.0.0.1:{ray_port}",
            f"http://127.0.0.1:{ml_port}",
            head,
            worker,
            root / "worker",
        )
    finally:
        for service in reversed(services):
            service.stop()
        shutil.rmtree(root, ignore_errors=True)


def _write_sweep(folder: Path, name: str, rounds: int, local_steps: int = 2) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        f"name: {name}\n"
        f"base: {{dataset: digits, clients: 6, rounds: {rounds}, local_steps: {local_steps}}}\n"
        "axes: {method: [fedavg], seed: [0, 1, 2, 3]}\n"
    )
    return path


def _runs(cluster: Cluster, experiment: str, view: int = ViewType.ACTIVE_ONLY) -> list:
    client = cluster.client()
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment} on the server"
    return client.search_runs([found.experiment_id], run_view_type=view, max_results=1000)


def _one_finished_run_per_point(runs: list, points: int) -> None:
    assert [r.info.status for r in runs] == ["FINISHED"] * points, [
        (r.info.status, r.data.tags.get("seed")) for r in runs
    ]
    assert len({r.data.tags["config_hash"] for r in runs}) == points
    assert sorted(r.data.tags["seed"] for r in runs) == [str(s) for s in range(points)]


def test_a_sweep_runs_on_both_nodes_and_logs_each_point_once_to_the_server(cluster):
    done = cluster.sweep(_write_sweep(cluster.root, "cluster-grid", rounds=2))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = _runs(cluster, "cluster-grid")
    _one_finished_run_per_point(runs, 4)
    assert len({r.data.tags["ray_node_id"] for r in runs}) == 2  # both nodes ran runs
    client = cluster.client()
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} >= {
        "metrics.csv",
        "config.yaml",
    }  # the artifact store


def test_a_killed_worker_node_loses_no_point_and_lands_none_twice(cluster):
    # runs long enough (seconds) to be caught training when the worker is stopped
    spec = _write_sweep(cluster.root, "cluster-kill", rounds=200, local_steps=20)
    worker_node = _node_id(cluster.worker_dir)
    sweep = subprocess.Popen(
        cluster.sweep_argv(spec),
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = cluster.client()
        deadline = time.monotonic() + SWEEP_S
        while (
            time.monotonic() < deadline and sweep.poll() is None
        ):  # a run training on the worker node
            experiment = client.get_experiment_by_name("cluster-kill")
            if experiment is not None and client.search_runs(
                [experiment.experiment_id],
                f"tags.ray_node_id = '{worker_node}' and attributes.status = 'RUNNING'",
            ):
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                "no run started on the worker node"
                + (sweep.communicate()[1][-3000:] if sweep.poll() is not None else "")
            )
        cluster.worker.stop()
        out, err = sweep.communicate(timeout=SWEEP_S)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 0, (
        out[-2000:] + err[-3000:]
    )  # Ray ran the lost task again on the head
    runs = _runs(cluster, "cluster-kill")
    _one_finished_run_per_point(runs, 4)
    # the attempt lost with the worker was either replaced (no checkpoint yet: its MLflow run is
    # superseded and deleted) or resumed from its checkpoint into the same MLflow run
    superseded = [
        r
        for r in _runs(cluster, "cluster-kill", ViewType.DELETED_ONLY)
        if "superseded" in r.data.tags
    ]
    resumed = [r for r in runs if "resumed_from_step" in r.data.tags]
    assert superseded or resumed
    assert all(r.data.tags["ray_node_id"] == worker_node for r in superseded)

    again = cluster.sweep(spec)  # the same command again: nothing left to train
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 of 4 runs already finished" in again.stderr
    assert [r.info.run_id for r in _runs(cluster, "cluster-kill")] == [r.info.run_id for r in runs]


def test_a_driver_without_the_cluster_token_is_one_line_and_exit_2(cluster):
    home = cluster.root / "home-without-token"  # no ~/.ray/auth_token to fall back on
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in cluster.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    done = subprocess.run(
        cluster.sweep_argv(_write_sweep(cluster.root, "cluster-no-token", rounds=1)),
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=SWEEP_S,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "requires token authentication" in done.stderr and "RAY_AUTH_TOKEN" in done.stderr, (
        done.stderr
    )
