"""A slow peer during a device run: per-exchange seconds clean, and with the slow peer
before and after the other peers drop it (issue 30, item 6).

Workload: P4 on digits, 4 local peers on 127.0.0.1 (`LocalPeers`, seeded device
simulation), `--rounds` co-training rounds after the grouping round, exchange timeout
`--exchange-timeout` s, the default drop policy (`device_slow_peer_exchanges` 2). The same
run three ways: clean; peer "3" withholding its end markers (`withhold`: each receiver
waits for it until the exchange timeout); peer "3" trickling them (`trickle`: the header
at once, the body `--trickle-delay` s later, below the 10 s per-frame cut-off but far
below `device_slow_peer_rate_bytes_s` after its 5 s grace). Choose with `--modes`.

Per-exchange seconds come from the round metrics: for each honest peer (0, 1, 2) and round,
the communication time of its exchanges (each exchange's wall time less the compute inside
it: waiting for the others included) over their number, then the mean over the honest
peers. "before the drop" is every round up to the one in which the last honest peer
dropped peer 3 (`device.3.slow_dropped_by` == 3), "after" the rounds after it. Targets:
peer 3 dropped by every honest peer after K = 2 exchanges; after the drop, per exchange
within 1.5x of clean.

Also reported per run: wall time, CPU time of this process and of its reaped children
(the peers), the peers' peak resident memory (`peak_rss_mb`, their own measurement) and this
process's, and the thread counts (torch threads per peer, CPU cores). The one-time
post-processing check is skipped (`P4BENCH_VERIFY=0`): it is not part of a run's time.

Prints one JSON object on the last line of stdout.

    .venv/bin/python bench/device_slow_peer.py [--rounds 8] [--exchange-timeout 20] [--modes clean,withhold,trickle]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("P4BENCH_VERIFY", "0")

from test_device_faults import WITHHOLDER, _device_config  # noqa: E402  (the test's misbehaving peer)

from p4bench.hookspecs import hookimpl  # noqa: E402
from p4bench.run.runner import run  # noqa: E402
from p4bench_device.launcher import LocalPeers  # noqa: E402

# peer "3" writes every end marker's header at once and its body DELAY s later
TRICKLER = r"""
import asyncio, os
from p4bench_device import admission
from p4bench_device.protocol import HEADER_BYTES, KIND_END, frame_header

DELAY = float(os.environ["P4BENCH_TRICKLE_DELAY_S"])
honest = admission.FrameConnection.send

async def send(self, frames, timeout, shaper=None):
    rest = [f for f in frames if f[0] != KIND_END]
    total = await honest(self, rest, timeout, shaper) if rest else 0
    for kind, seq, body in (f for f in frames if f[0] == KIND_END):
        async with self.lock:
            self.writer.write(frame_header(kind, seq, len(body)))
            await self.writer.drain()
            await asyncio.sleep(DELAY)
            self.writer.write(body)
            await self.writer.drain()
        total += HEADER_BYTES + len(body)
    return total

admission.FrameConnection.send = send
from p4bench_device.cli import main
main()
"""

HONEST = ("0", "1", "2")


class Cluster(LocalPeers):
    """Four local peers; peer "3" runs `script` (None: honest)."""

    def __init__(self, script: str | None) -> None:
        super().__init__(4)
        self.script = script

    def command(self, spec):
        argv = super().command(spec)
        return (
            [sys.executable, "-c", self.script, *argv[3:]]
            if self.script and spec.id == "3"
            else argv
        )


class Rounds:
    """Observer: each round's phase, number and metrics."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []

    @hookimpl
    def round_finished(self, run, report):
        self.rounds.append(
            {"phase": report.phase, "round": report.round, "metrics": dict(report.metrics)}
        )


def per_exchange_s(metrics: dict) -> tuple[float, dict[str, float]]:
    """(mean over the honest peers of their comm seconds per exchange, per exchange name: mean over them)."""
    names: dict[str, list[float]] = {}
    means = []
    for peer in HONEST:
        prefix = f"device.{peer}.exchange."
        mine = {
            k[len(prefix) : -len(".comm_s")]: v
            for k, v in metrics.items()
            if k.startswith(prefix) and k.endswith(".comm_s")
        }
        if mine:
            means.append(sum(mine.values()) / len(mine))
            for name, value in mine.items():
                names.setdefault(name, []).append(value)
    return (statistics.mean(means) if means else float("nan")), {
        k: round(statistics.mean(v), 3) for k, v in names.items()
    }


def one_run(mode: str, args: argparse.Namespace) -> dict:
    script = {"clean": None, "withhold": WITHHOLDER, "trickle": TRICKLER}[mode]
    os.environ["P4BENCH_TRICKLE_DELAY_S"] = str(args.trickle_delay)
    observer = Rounds()
    before_cpu, started = os.times(), time.perf_counter()
    with Cluster(script) as cluster:
        config = _device_config(
            cluster,
            tempfile.mkdtemp(prefix="p4bench-bench-slow-"),
            rounds=args.rounds,
            options={"device_exchange_timeout_s": args.exchange_timeout},
        )
        summary = run(config, observers=[observer], track=False).summary
        threads = cluster.threads
    wall = time.perf_counter() - started
    after_cpu = os.times()
    cpu = sum(
        after_cpu[i] - before_cpu[i] for i in range(4)
    )  # user + system, this process and reaped children
    device = summary["device"]
    rounds = []
    dropped_at = None
    for index, entry in enumerate(observer.rounds):
        seconds, names = per_exchange_s(entry["metrics"])
        rounds.append(
            {
                "phase": entry["phase"],
                "round": entry["round"],
                "per_exchange_s": round(seconds, 3),
                "exchanges": names,
                "slow_dropped_by": entry["metrics"].get("device.3.slow_dropped_by", 0.0),
            }
        )
        if dropped_at is None and entry["metrics"].get("device.3.slow_dropped_by", 0) >= len(
            HONEST
        ):
            dropped_at = index
    peak = max(
        (
            p.get("peak_rss_mb", 0.0)
            for peer in device["peers"].values()
            for p in peer["phases"].values()
        ),
        default=0.0,
    )
    result = {
        "mode": mode,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "peers_peak_rss_mb": round(peak, 1),
        "torch_threads_per_peer": threads,
        "rounds": rounds,
        "slow_dropped": [
            {k: e.get(k) for k in ("peer", "by", "phase", "round", "exchange", "reason")}
            for e in device.get("slow_dropped", [])
        ],
        "launcher_dropped": device["dropped"],
        "finished": all(p["finished"] for p in device["peers"].values()),
    }
    series = [r["per_exchange_s"] for r in rounds]
    if mode == "clean":
        result["per_exchange_s"] = round(statistics.mean(series), 3)
    elif dropped_at is not None:
        result["dropped_after_round"] = (
            f"{rounds[dropped_at]['phase']} {rounds[dropped_at]['round']}"
        )
        result["per_exchange_s_before_drop"] = round(statistics.mean(series[: dropped_at + 1]), 3)
        after = series[dropped_at + 1 :]
        result["per_exchange_s_after_drop"] = round(statistics.mean(after), 3) if after else None
    print(
        json.dumps({k: v for k, v in result.items() if k != "rounds"}), file=sys.stderr, flush=True
    )  # progress
    return result


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=8, help="co-training rounds (after one grouping round)"
    )
    parser.add_argument(
        "--exchange-timeout", type=float, default=20.0, help="device_exchange_timeout_s"
    )
    parser.add_argument(
        "--trickle-delay",
        type=float,
        default=8.0,
        help="seconds between a marker's header and body",
    )
    parser.add_argument("--modes", default="clean,withhold,trickle")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs = {mode: one_run(mode, args) for mode in modes}
    clean = runs.get("clean", {}).get("per_exchange_s")
    targets = {}
    for mode in ("withhold", "trickle"):
        if mode in runs:
            slow = runs[mode]
            by = {e["by"] for e in slow["slow_dropped"] if e["peer"] == "3"}
            after = slow.get("per_exchange_s_after_drop")
            targets[mode] = {
                "dropped_by_every_honest_peer": by == set(HONEST),
                "after_drop_ratio_to_clean": round(after / clean, 3) if after and clean else None,
                "after_drop_within_1.5x_clean": bool(
                    after is not None and clean and after <= 1.5 * clean
                ),
                "run_finished": slow["finished"],
            }
    out = {
        "bench": "device_slow_peer",
        "method": "p4",
        "local_peers": 4,
        "rounds": args.rounds,
        "exchange_timeout_s": args.exchange_timeout,
        "slow_peer_exchanges": 2,
        "cpu_count": os.cpu_count(),
        "bench_process_peak_rss_mb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
        ),
        "runs": runs,
        "targets": targets,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
