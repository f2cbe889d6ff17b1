"""P4 against every baseline on digits at equal privacy: alpha partition (similarity 0.5),
one target epsilon (15, under the suite's default accountant, as `reproduce`) and one
neighbouring relation (add-remove) for every private
run, lr tuned per method on the evaluation clients only, then 3 seeds.

Equal privacy (as `p4bench reproduce heterogeneity`, see p4bench/studies/equal_privacy.py): every
private run uses `--neighbouring` (add-remove by default; P4's own default is replace-one,
and the same epsilon under another relation is another guarantee) and must have a
certified epsilon; otherwise the script refuses (exit 2, naming the runs) unless
`--allow-mixed-privacy`, and the table marks each method's privacy. Local and centralized
training are non-private, as in `reproduce` (nothing leaves a client; centralized is a
pooled reference); `--private-baselines` trains them with DP at the same epsilon instead.
Nobody attacks, so P4 runs without its secure aggregation (defense none): with no attacker
it only discards honest updates.

For each method the local step size is chosen from a small grid (`reproduce`'s) by the mean
accuracy of the *evaluation* clients (RunInfo.evaluation; never the reported ones) in one
tuning run (seed --tune-seed), then the method runs with that lr for every seed in
--seeds. Reported: mean and std over seeds of the mean accuracy of the reported clients
(benign, non-evaluation), privacy, epsilon (its accountant and rdp), bytes sent per client, wall time. Runs go
to worker processes, one torch thread each. Prints a markdown table, then one JSON object
on the last line.

    python bench/compare_digits.py [--rounds 30] [--workers 2] [--grid 0.1 0.5 2.0] [--similarity 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

METHODS = ("p4", "local", "centralized", "fedavg", "scaffold", "proxyfl", "dp-dsgt", "dp-dsgd")
PERSONALIZED = {"p4", "local", "proxyfl"}
BASELINES = ("local", "centralized")  # non-private unless --private-baselines
TUNE_GRID = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]  # p4bench.studies.reproduce.TUNE_GRID


def _init_worker() -> None:
    os.environ.setdefault("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    from p4bench.run.threads import set_process_share

    # runs are many small kernels; one thread per worker avoids contention (each run's default)
    set_process_share(1)


def method_options(method: str, common: dict, private_baselines: bool) -> dict:
    """The run options of one method: the shared ones, with local / centralized non-private
    unless asked, and no defense (nobody attacks: P4's secure aggregation would only drop
    honest updates)."""
    options = {**common, "defense": "none"}
    if method in BASELINES and not private_baselines:
        options.update(epsilon=None, no_dp=True)
    return options


def one_run(method: str, lr: float, seed: int, common: dict) -> dict:
    """Summary of one run: reported and evaluation-client accuracies, privacy, bytes, time."""
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    result = run(RunConfig(method=method, lr=lr, seed=seed, **common), track=False)
    accuracy, info, summary = result.outcome.accuracy, result.info, result.summary
    return {
        "method": method,
        "lr": lr,
        "seed": seed,
        "reported": float(accuracy[info.reported].mean()),
        "evaluation": float(accuracy[info.evaluation].mean()),
        "private": summary.get("private", summary.get("epsilon") is not None),
        "epsilon_certified": summary.get("epsilon_certified"),
        "uncertified_reason": summary.get("uncertified_reason"),
        "neighbouring": summary.get("neighbouring"),
        "defense": summary.get("defense"),
        "epsilon": summary.get("epsilon"),
        "epsilon_rdp": summary.get("epsilon_rdp"),
        "accountant": summary.get("accountant"),
        "sigma": summary.get("noise_multiplier"),
        "clients_stopped": summary.get("clients_stopped") or 0,
        "bytes_per_client": summary["client_bytes_sent"]["mean"],
        "wall_s": summary["wall_time_s"],
        "threads": summary.get("threads"),  # what the run computed on
    }


def privacy_check(rows: dict, allow_mixed: bool):
    """The equal-privacy rule over every run (UsageError naming the runs unless allowed)."""
    from p4bench.studies.equal_privacy import check_privacy, from_summary

    statuses = [
        from_summary(r, f"{m} lr={r['lr']:g} seed={r['seed']}")
        for m, runs in rows.items()
        for r in runs
    ]
    return check_privacy(statuses, allow_mixed=allow_mixed, what="bench/compare_digits.py")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--grid", nargs="+", type=float, default=TUNE_GRID)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--tune-seed", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--epsilon", type=float, default=15.0)
    parser.add_argument("--similarity", type=float, default=0.5)
    parser.add_argument("--features", default="raw")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--results-dir", default="/tmp/p4bench-compare")
    parser.add_argument(
        "--accountant", default=None, help="privacy accountant (default: the suite's, as reproduce)"
    )
    parser.add_argument(
        "--neighbouring",
        default="add-remove",
        choices=("add-remove", "replace-one"),
        help="the one neighbouring relation of every private run",
    )
    parser.add_argument(
        "--private-baselines",
        action="store_true",
        help="train local and centralized with DP at the same epsilon (default: non-private)",
    )
    parser.add_argument(
        "--allow-mixed-privacy",
        action="store_true",
        help="report runs under different relations or with uncertified epsilons (marked)",
    )
    args = parser.parse_args(argv)
    common = dict(
        dataset="digits",
        partitioner="alpha",
        similarity=args.similarity,
        clients=args.clients,
        rounds=args.rounds,
        epsilon=args.epsilon,
        neighbouring=args.neighbouring,
        features=args.features,
        results_dir=args.results_dir,
        **({"accountant": args.accountant} if args.accountant else {}),
    )
    options = {m: method_options(m, common, args.private_baselines) for m in args.methods}
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers, initializer=_init_worker) as pool:
        tuning = {
            (m, lr): pool.submit(one_run, m, lr, args.tune_seed, options[m])
            for m in args.methods
            for lr in args.grid
        }
        chosen = {}
        final = {}
        for m in args.methods:  # submit each method's seeds as soon as its tuning is done
            scores = {lr: tuning[(m, lr)].result()["evaluation"] for lr in args.grid}
            chosen[m] = max(args.grid, key=lambda lr: (scores[lr], -lr))
            final[m] = [pool.submit(one_run, m, chosen[m], seed, options[m]) for seed in args.seeds]
        rows = {m: [f.result() for f in final[m]] for m in args.methods}
        tuned = {
            m: {str(lr): round(tuning[(m, lr)].result()["evaluation"], 4) for lr in args.grid}
            for m in args.methods
        }
        tuning_rows = {m: [tuning[(m, lr)].result() for lr in args.grid] for m in args.methods}
    total = time.perf_counter() - started
    from p4bench.studies.equal_privacy import UnequalPrivacyError

    try:
        verdict = privacy_check(
            {m: rows[m] + tuning_rows[m] for m in args.methods}, args.allow_mixed_privacy
        )
    except UnequalPrivacyError as exc:  # a usage error: exit 2, naming the runs
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    marks = {
        m: " / ".join(dict.fromkeys(s.mark for s in verdict.runs if s.method == m))
        for m in args.methods
    }

    table = []
    for m in args.methods:
        accs = [r["reported"] for r in rows[m]]
        private = [r for r in rows[m] if r["private"]]
        table.append(
            {
                "method": m,
                "kind": "personalized" if m in PERSONALIZED else "consensus",
                "lr": chosen[m],
                "privacy": marks[m],
                "defense": rows[m][0]["defense"] or "none",
                "accuracy_mean": statistics.fmean(accs),
                "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "epsilon": max((r["epsilon"] for r in private), default=None),
                "epsilon_rdp": max((r["epsilon_rdp"] for r in private), default=None),
                "sigma": rows[m][0]["sigma"],
                "clients_stopped": sum(r["clients_stopped"] for r in rows[m]),
                "bytes_per_client": statistics.fmean(r["bytes_per_client"] for r in rows[m]),
                "wall_s": statistics.fmean(r["wall_s"] for r in rows[m]),
                "tuning": tuned[m],
                "per_seed": [round(a, 4) for a in accs],
            }
        )
    table.sort(key=lambda row: -row["accuracy_mean"])
    baselines = [m for m in BASELINES if m in args.methods]
    accountant = next(
        (r["accountant"] for m in args.methods for r in rows[m] if r.get("accountant")), "none"
    )
    print(
        f"digits, alpha partition (similarity {common['similarity']}), {args.clients} clients, {args.rounds} rounds, "
        f"target epsilon {args.epsilon} ({accountant}), {args.neighbouring} neighbouring for every private run, seeds "
        f"{args.seeds}, lr tuned on evaluation clients over {args.grid}, no attack and no defense"
    )
    if baselines:
        print(
            f"{' and '.join(baselines)}: "
            f"{'private (DP at the same epsilon)' if args.private_baselines else 'non-private'}"
        )
    print(verdict.note())
    if verdict.warning:
        print(f"WARNING: {verdict.warning}")
    print()
    print(
        f"| method | kind | privacy | lr | accuracy mean | std | epsilon ({accountant}) | epsilon (rdp) | sigma | "
        "MB sent / client | s / run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for row in table:
        print(
            f"| {row['method']} | {row['kind']} | {row['privacy']} | {row['lr']:g} | {row['accuracy_mean']:.4f} | "
            f"{row['accuracy_std']:.4f} | {num(row['epsilon'], '.2f')} | {num(row['epsilon_rdp'], '.2f')} | "
            f"{num(row['sigma'], '.3f')} | "
            f"{row['bytes_per_client'] / 1e6:.2f} | {row['wall_s']:.1f} |"
        )
    order = [row["method"] for row in table]
    consensus = [
        row["accuracy_mean"]
        for row in table
        if row["kind"] == "consensus" and row["method"] != "centralized"
    ]
    personalized = [row["accuracy_mean"] for row in table if row["kind"] == "personalized"]
    summary = {
        "table": table,
        "order": order,
        "p4_first": bool(order and order[0] == "p4"),
        "personalized_above_consensus": bool(
            consensus and personalized and min(personalized) > max(consensus)
        ),
        "total_seconds": round(total, 1),
        "config": common,
        "grid": args.grid,
        "seeds": args.seeds,
        "private_baselines": args.private_baselines,
        "privacy": verdict.note(),
        "privacy_mixed": not verdict.ok,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
