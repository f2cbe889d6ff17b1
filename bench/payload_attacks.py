"""One compromised client of four against the receive gate (issue 30's acceptance).

For FedAvg with m-Krum and P4 with p4-secure, on digits with 4 clients (one malicious:
malicious_fraction 0.25) and a seed: the clean run, then one run under each of the
attacks `nan-update`, `duplicate-messages` and `weight-lie`, in the simulator and on
the device runtime (`--local-peers 4`, seeded device simulation, one process per client
over TLS on 127.0.0.1). Target: the honest clients' mean accuracy within 2 points of
the clean run, every rejection named by sender.

Prints one JSON object per (method, runtime, attack) and a last JSON line with the
bench convention: threads, wall and CPU seconds, peak memory.

    .venv/bin/python bench/payload_attacks.py [--rounds 10] [--runtimes simulation device]
                                              [--methods fedavg p4] [--seed 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

from p4bench.config import RunConfig
from p4bench.run.runner import run
from p4bench.run.threads import default_threads

ATTACKS = (None, "nan-update", "duplicate-messages", "weight-lie")
DEFENSES = {"fedavg": "m-krum", "p4": "p4-secure"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
        1 if sys.platform == "darwin" else 1024
    )


def one(
    method: str, runtime: str, attack: str | None, args: argparse.Namespace
) -> tuple[dict, np.ndarray, np.ndarray]:
    """The row of one run, each client's final accuracy, and the harness's reported mask."""
    changes: dict = dict(
        method=method,
        clients=4,
        rounds=args.rounds,
        seed=args.seed,
        eval_fraction=0.0,
        attack=attack,
        defense=DEFENSES[method],
        malicious_fraction=0.25,
        results_dir=tempfile.mkdtemp(prefix="p4bench-bench-gate-"),
    )
    if runtime == "device":
        changes.update(
            runtime="device",
            noise_source="seeded",
            device_simulation=True,
            options={"device_local_peers": 4},
        )
    started = time.perf_counter()
    result = run(RunConfig(**changes), track=False)
    summary = result.summary
    row = {
        "method": method,
        "defense": DEFENSES[method],
        "runtime": runtime,
        "attack": attack or "none",
        "accuracy": round(float(summary["accuracy_mean"]), 4),
        "rejections": summary.get("rejections", {}),
        "seconds": round(time.perf_counter() - started, 1),
        "threads": summary.get("threads"),  # what the run computed on
    }
    return (
        row,
        np.asarray(result.outcome.accuracy, dtype=float),
        np.asarray(result.info.reported, dtype=bool),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(DEFENSES), choices=list(DEFENSES))
    parser.add_argument(
        "--runtimes", nargs="+", default=["simulation", "device"], choices=["simulation", "device"]
    )
    args = parser.parse_args()
    os.environ.setdefault(
        "P4BENCH_VERIFY", "0"
    )  # the post-processing check is not what is measured here
    wall, cpu = time.perf_counter(), time.process_time()
    worst = 0.0
    for method in args.methods:
        for runtime in args.runtimes:
            clean: np.ndarray | None = None
            for attack in ATTACKS:
                row, accuracy, reported = one(method, runtime, attack, args)
                if attack is None:
                    clean = accuracy
                else:  # the same (honest) clients in the clean run: the attacked run reports the benign only
                    assert clean is not None
                    row["clean_accuracy_same_clients"] = round(float(clean[reported].mean()), 4)
                    row["drop_points"] = round(
                        100 * (row["clean_accuracy_same_clients"] - row["accuracy"]), 2
                    )
                    worst = max(worst, row["drop_points"])
                print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "worst_drop_points": worst,
                "target_points": 2.0,
                "threads": default_threads(),  # each run's (its row's `threads`)
                "wall_s": round(time.perf_counter() - wall, 1),
                "cpu_s": round(time.process_time() - cpu, 1),
                "peak_rss_mb": round(peak_rss_mb(), 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
