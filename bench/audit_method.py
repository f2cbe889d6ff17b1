"""The method-level audit's acceptance cases (#29): five planted or known leaks it must
flag (`refuted` by the one-run bound, or `leaks` from its replay checks) and four honest
methods it must not refute, on digits.

    python bench/audit_method.py [--rounds R] [--clients M] [--canaries-per-client m]
                                 [--cases NAME ...] [--max-runs N] [--threads N]

Each case is audited with one run first; when that run's ceiling is below the claim
(inconclusive), again with the number of runs the audit recommends (capped by
--max-runs). Settings are the run's defaults (digits, 20 clients, 30 rounds, epsilon 8)
unless given. Prints one JSON object per case (bound, claim, ceiling, verdict, runs,
seconds, and the bench convention: threads, wall and CPU seconds, peak memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from p4bench.audit.method_level import run_method_audit
from p4bench.config import RunConfig
from p4bench.host.manager import create_plugin_manager
from p4bench.run.threads import default_threads
from p4bench.testing.audit_faults import FAULTY_METHODS, oversampled, unclipped

# name -> (method, options, fault of the mechanism, expected verdict)
CASES: dict[str, tuple[str, dict[str, Any], Any, str]] = {
    "p4-clipping-removed": ("p4", {}, unclipped, "refuted"),
    "fedavg-clipping-removed": ("fedavg", {}, unclipped, "refuted"),
    "fedavg-sampling-5x": ("fedavg", {}, oversampled(5.0), "refuted"),
    "leaky-proxyfl-sends-private-model": ("leaky-proxyfl", {}, None, "leaks"),
    "proxyfl-teacher-private": ("proxyfl", {"teacher": "private"}, None, "leaks"),
    "fedavg": ("fedavg", {}, None, "consistent"),
    "dp-dsgd": ("dp-dsgd", {}, None, "consistent"),
    "p4": ("p4", {}, None, "consistent"),
    "pdsl": ("pdsl", {}, None, "consistent"),
}


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (
        1 if sys.platform == "darwin" else 1024
    )


def _finite(value: float, digits: int) -> float | None:
    """A rate of the multi-run test, or None under the one-run bound, which defines none (NaN)."""
    return round(value, digits) if value == value else None


def audit(name: str, args: argparse.Namespace, runs: int) -> dict[str, Any]:
    method, options, fault, expected = CASES[name]
    changes: dict[str, Any] = dict(method=method, options=options, epsilon=8.0, seed=args.seed)
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.clients:
        changes["clients"] = args.clients
    if args.threads:
        changes["threads"] = args.threads  # the runs set their own threads (p4bench.run.threads)
    pm = create_plugin_manager()
    pm.register(FAULTY_METHODS)
    result = run_method_audit(
        RunConfig(**changes),
        runs=runs,
        canaries_per_client=args.canaries_per_client,
        wrap_mechanism=fault,
        plugin_manager=pm,
        track=False,
    )
    b = result.bound
    return {
        "bound": round(b.epsilon_lower, 3),
        "claim": round(result.claimed_epsilon, 3),
        "ceiling": round(b.ceiling, 3),
        "verdict": result.verdict,
        "replays": (result.behaviour or {}).get("status"),
        "isolation": (result.behaviour or {}).get("isolation"),
        "runs": runs,
        "trials": b.trials,
        "tpr_lower": _finite(b.tpr_lower, 4),
        "fpr_upper": _finite(b.fpr_upper, 6),
        "correct": b.correct,
        "runs_needed": result.runs_needed() if result.inconclusive else None,
        "seconds": round(result.seconds or 0.0, 1),
        "expected": expected,
        "line": result.line(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="T (default: the run's, 30)")
    parser.add_argument("--clients", type=int, default=None, help="M (default: the run's, 20)")
    parser.add_argument("--canaries-per-client", type=int, default=None)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--max-runs", type=int, default=64, help="cap on the recommended runs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.cases:
        wall, cpu = time.perf_counter(), time.process_time()
        first = audit(name, args, 1)
        final = first
        if first["verdict"] == "inconclusive" and first["runs_needed"]:
            final = audit(name, args, min(int(first["runs_needed"]), args.max_runs))
        print(
            json.dumps(
                {
                    "case": name,
                    **{
                        k: final[k]
                        for k in (
                            "bound",
                            "claim",
                            "ceiling",
                            "verdict",
                            "replays",
                            "isolation",
                            "runs",
                            "seconds",
                        )
                    },
                    "expected": final["expected"],
                    "trials": final["trials"],
                    "correct": final["correct"],
                    "tpr_lower": final["tpr_lower"],
                    "fpr_upper": final["fpr_upper"],
                    "recommended_runs": first["runs_needed"],
                    "first_run": {k: first[k] for k in ("bound", "ceiling", "verdict", "seconds")},
                    "rounds": args.rounds or 30,
                    "clients": args.clients or 20,
                    "canaries_per_client": args.canaries_per_client,
                    "threads": args.threads or default_threads(),  # what its runs computed on
                    "wall_s": round(time.perf_counter() - wall, 1),
                    "cpu_s": round(time.process_time() - cpu, 1),
                    "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                    "line": final["line"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
