"""How time per round and peak memory grow with the number of clients (issue 35).

For fedavg, P4 (linear model; its grouping phase timed apart) and PDSL on a ring, on
synthetic data (Synthetic(1, 1), 60 features, 50 samples per client, natural partition
(IID for PDSL, whose public pool comes out first),
non-private, one torch thread; PDSL's validation set Q 200 records at every point, so an
agent's work does not grow with M), each point runs in a fresh subprocess so that its peak
RSS is its own. Prints one JSON line per (method, clients) point and, last, one line
with the growth exponent per method and phase (least-squares slope of log time against
log clients), the thread count, wall and CPU seconds.

    .venv/bin/python bench/scale.py            # the small grid (minutes)
    .venv/bin/python bench/scale.py --full     # the large grid (P4 to 10,000 clients,
                                               # fedavg to 100,000: hours, tens of GB)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

SMALL = {"fedavg": [100, 300, 1000], "p4": [100, 300, 1000], "pdsl": [10, 20, 40]}
FULL = {
    "fedavg": [1000, 10_000, 100_000],
    "p4": [300, 1000, 3000, 10_000],
    "pdsl": [20, 40, 80, 160],
}
ROUNDS = {"fedavg": 3, "p4": 3, "pdsl": 9}  # PDSL's rounds take milliseconds: a median of 8


def point(method: str, clients: int) -> dict:
    """One run in this process: seconds per round (median after the first) and per phase."""
    os.environ.setdefault("P4BENCH_VERIFY", "0")
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    options: dict = {"group_size": 8} if method == "p4" else {}
    if method == "pdsl":  # twice the records generated: the public pool Q comes out of them first
        # Q fixed at the smallest point's pool (20% of 100 records x 10 clients): the pool
        # grows with M, and Shapley scores every agent's candidates on all of Q
        options = {"topology": "ring", "synthetic_samples": 100, "val_size": 200}
    # PDSL holds out a labeled public pool Q first: the natural partition would leave its
    # writers short, so its clients draw IID from the rest
    partitioner = "iid" if method == "pdsl" else "natural"
    config = RunConfig(
        method=method,
        dataset="synthetic",
        partitioner=partitioner,
        clients=clients,
        samples_per_client=50,
        rounds=ROUNDS[method],
        local_steps=1,
        seed=1,
        eval_fraction=0.0,
        no_dp=True,
        options=options,
        threads=1,  # the growth exponents compare one core's work
    )
    started = time.perf_counter()
    result = run(config, track=False)
    by_phase: dict[str, list[float]] = {}
    for report in result.outcome.reports:
        by_phase.setdefault(report.phase, []).append(report.seconds)
    last = list(by_phase)[-1]
    later = sorted(by_phase[last][1:] or by_phase[last])
    return {
        "method": method,
        "clients": clients,
        "round_s": round(later[len(later) // 2], 4),
        "phases_s": {phase: round(sum(values), 3) for phase, values in by_phase.items()},
        "run_s": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": result.summary["threads"],  # what the run computed on
    }


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (None with fewer than two points)."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    var = sum((p[0] - mx) ** 2 for p in pairs)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pairs) / var, 2) if var else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the large grid")
    parser.add_argument("--methods", nargs="+", default=list(SMALL), choices=list(SMALL))
    parser.add_argument("--point", nargs=2, metavar=("METHOD", "CLIENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(point(args.point[0], int(args.point[1]))), flush=True)
        return
    grid = FULL if args.full else SMALL
    wall, growth = time.perf_counter(), {}
    cpu = 0.0
    for method in args.methods:
        rows = []
        for clients in grid[method]:
            child = subprocess.run(
                [sys.executable, __file__, "--point", method, str(clients)],
                capture_output=True,
                text=True,
                check=False,
            )
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = usage.ru_utime + usage.ru_stime
            lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
            if child.returncode or not lines:
                row = {
                    "method": method,
                    "clients": clients,
                    "error": (child.stderr.strip().splitlines() or ["?"])[-1],
                }
            else:
                row = json.loads(lines[-1])
                rows.append(row)
            print(json.dumps(row), flush=True)
        clients_ = [float(r["clients"]) for r in rows]
        growth[method] = {
            "round": exponent(clients_, [r["round_s"] for r in rows]),
            "peak_rss": exponent(clients_, [r["peak_rss_mb"] for r in rows]),
        }
        for phase in rows[0]["phases_s"] if rows else {}:
            growth[method][phase] = exponent(
                clients_, [r["phases_s"].get(phase, 0.0) for r in rows]
            )
    print(
        json.dumps(
            {
                "growth_exponents": growth,
                "threads": 1,
                "wall_s": round(time.perf_counter() - wall, 1),
                "cpu_s": round(cpu, 1),
                "full": args.full,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
