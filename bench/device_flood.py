"""A connection flood on one device peer during a run: wall time with and without it.

Workload (issue 16's acceptance): P4 on digits, `--local-peers 4`, 6 co-training
rounds; from the moment the launcher starts connecting, 300 plain TCP sockets (no TLS,
never sending) are opened at peer "1" and held, those it closes reopened, until the
run ends. The same run unflooded first. Target: the flooded run takes at most 1.5x the
unflooded one and drops no peer. Seeded device simulation: both runs compute the same
numbers, so their accuracies must agree (a check that the flood changed nothing but time).

Prints one JSON object on the last line of stdout.

    .venv/bin/python bench/device_flood.py [--connections 300] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_device_faults import Flood  # noqa: E402  (the same flood the fault test uses)

from p4bench.config import RunConfig  # noqa: E402
from p4bench.runner import run  # noqa: E402


def timed(config: RunConfig, observers: list) -> tuple[float, dict]:
    start = time.perf_counter()
    summary = run(config, observers=observers, track=False).summary
    return time.perf_counter() - start, summary


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    results = tempfile.mkdtemp(prefix="p4bench-bench-flood-")
    config = RunConfig(method="p4", clients=4, rounds=args.rounds, local_steps=2, seed=4, eval_fraction=0.0,
                       runtime="device", results_dir=results, noise_source="seeded", device_simulation=True,
                       options={"device_local_peers": 4})
    clean_s, clean = timed(config, [])
    flood = Flood(port=0, count=args.connections)
    # the local peers' ports are chosen when the run starts: aim the flood at peer "1" then
    from p4bench.plugins.device import launcher

    original = launcher.Launcher.run

    def run_and_aim(self, job, on_round):
        flood.port = self.peers.by_id["1"].port
        flood.start()  # before the launcher connects, until the run ends
        return original(self, job, on_round)

    launcher.Launcher.run = run_and_aim
    try:
        flooded_s, flooded = timed(config, [])
    finally:
        launcher.Launcher.run = original
        flood.finish()
    rejected = flooded["device"]["peers"]["1"]["transport"]["rejected"]
    out = {
        "bench": "device_flood", "method": "p4", "local_peers": 4, "rounds": args.rounds,
        "connections": args.connections, "sockets_opened": flood.opened,
        "unflooded_s": round(clean_s, 2), "flooded_s": round(flooded_s, 2), "ratio": round(flooded_s / clean_s, 3),
        "dropped": flooded["device"]["dropped"], "absences": len(flooded["device"]["absences"]),
        "flooded_peer_rejections": rejected,
        "same_accuracy": clean["accuracy_per_client"] == flooded["accuracy_per_client"],
        "target": {"ratio_le_1.5": flooded_s / clean_s <= 1.5, "no_peer_dropped": not flooded["device"]["dropped"]},
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
