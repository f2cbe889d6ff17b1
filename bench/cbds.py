"""Time the CBDS partitioner (Karras et al., Algorithm 1) on a CIFAR-sized label pool.

    python bench/cbds.py [--clients 100 1000] [--labels 10] [--per-label 6000] [--alpha 0.01 1] [--seed 0]

For each (clients, alpha): the seconds of the whole partition (the swap loop, rounding
and the index hand-out) on a pool of `labels` x `per-label` samples (CIFAR-10 pooled:
10 x 6,000), the number of swaps, u(P) before and after, the undersampling (total and
worst label) and the samples per client. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from p4bench.config import RunConfig
from p4bench.data.cbds import CBDSPartitioner
from p4bench.rng import SEED_PARTITION, harness_rng


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--labels", type=int, default=10)
    parser.add_argument("--per-label", type=int, default=6000)
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.01, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(args.labels), args.per_label))
    runs = []
    for clients in args.clients:
        for alpha in args.alpha:
            partitioner = CBDSPartitioner()
            config = RunConfig(options={"cbds_alpha": alpha})
            started = time.perf_counter()
            parts = partitioner.partition(
                labels, args.labels, clients, None, harness_rng(args.seed, SEED_PARTITION), config
            )
            seconds = time.perf_counter() - started
            stats = partitioner.report.stats
            runs.append(
                {
                    "clients": clients,
                    "alpha": alpha,
                    "seconds": round(seconds, 4),
                    "swaps": int(stats["swaps"]),
                    "u_before": round(stats["u_before"], 6),
                    "u_after": stats["u_after"],
                    "undersampling": stats["undersampling"],
                    "undersampling_worst_label": stats["undersampling_worst_label"],
                    "samples_per_client": len(parts[0]),
                    "used_fraction": round(stats["used_fraction"], 6),
                }
            )
    print(
        json.dumps(
            {"labels": args.labels, "per_label": args.per_label, "seed": args.seed, "runs": runs}
        )
    )


if __name__ == "__main__":
    main()
