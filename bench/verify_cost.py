"""What verifying the run itself costs: a default P4 run on digits verified in full
against the same run unverified (issue 44, part 5).

    python bench/verify_cost.py [--repeats 1] [--rounds 30] [--method p4] [-- EXTRA RUN OPTIONS]

Each run is a fresh `p4bench run --json` process (the script next to this interpreter)
with its own results folder and an empty verdict cache, so the full run records itself
and replays once (`--verify full`) and the other does nothing of the kind (`--verify
off`). Times are the child's own (`os.wait4`: user + system CPU of it and of what it
waited for, such as the tracking worker), medians over the repeats, run alternately.
Prints one JSON line:

- `cpu_full_s`, `cpu_off_s`, `cpu_ratio` (full / off: the issue's target <= 2.2);
- `wall_full_s`, `wall_off_s`, `wall_ratio`;
- `peak_rss_full_mb`, `peak_rss_off_mb` (the largest resident set of the child or its children);
- `threads` (torch's intra-op threads in the runs), `verification_cpu_s` (the replay's own
  CPU time, as the run's summary reports it), `certified_full`, `certified_off`,
  `post_processing`, `record_isolation`, and the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(sys.executable).with_name("p4bench")


def _one(mode: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="p4bench-verify-cost-") as folder:
        env = {**os.environ, "P4BENCH_CACHE_DIR": str(Path(folder) / "cache")}
        command = [
            str(SCRIPT),
            "run",
            "--method",
            args.method,
            "--rounds",
            str(args.rounds),
            "--verify",
            mode,
            "--results-dir",
            str(Path(folder) / "runs"),
            "--json",
            *extra,
        ]
        started = time.perf_counter()
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
        )
        assert child.stdout is not None
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {child.returncode}")
    summary = json.loads(out.strip().splitlines()[-1])
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss_mb": usage.ru_maxrss / 1024,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--method", default="p4")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    load_before = os.getloadavg()[0]
    full, off = [], []
    for _ in range(args.repeats):
        off.append(_one("off", args, extra))
        full.append(_one("full", args, extra))
    median = statistics.median
    summary_full, summary_off = full[-1]["summary"], off[-1]["summary"]
    result = {
        "bench": "verify_cost",
        "method": args.method,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": summary_full.get("threads"),  # what the runs computed on (their summaries)
        "threads_off": summary_off.get("threads"),
        "cpu_full_s": round(median(r["cpu"] for r in full), 3),
        "cpu_off_s": round(median(r["cpu"] for r in off), 3),
        "wall_full_s": round(median(r["wall"] for r in full), 3),
        "wall_off_s": round(median(r["wall"] for r in off), 3),
        "peak_rss_full_mb": round(max(r["rss_mb"] for r in full), 1),
        "peak_rss_off_mb": round(max(r["rss_mb"] for r in off), 1),
        "verification_cpu_s": summary_full.get("verification_cpu_s"),
        "certified_full": summary_full.get("epsilon_certified"),
        "certified_off": summary_off.get("epsilon_certified"),
        "post_processing": summary_full.get("post_processing"),
        "record_isolation": summary_full.get("record_isolation"),
        "accuracy_full": summary_full.get("accuracy_mean"),
        "accuracy_off": summary_off.get("accuracy_mean"),
        "load_average_at_start": round(load_before, 2),
        "load_average_at_end": round(os.getloadavg()[0], 2),
    }
    result["cpu_ratio"] = round(result["cpu_full_s"] / result["cpu_off_s"], 3)
    result["wall_ratio"] = round(result["wall_full_s"] / result["wall_off_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
