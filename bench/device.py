"""The P4 device experiment on loopback: two peers, next to the paper's Raspberry Pi figures.

Workload (the paper's section 6 device setting, scaled to this machine): P4 with two
clients in one group, each a `p4bench device serve` process on 127.0.0.1 exchanging
TLS frames; a CIFAR-10-shaped linear model (3072 -> 10, 30,730 parameters) on
synthetic features (the `synthetic` dataset with 3072 dimensions and 10 classes);
DP-SGD on the proxy (noise multiplier 1, clip 1) and the private model distilled
alongside, K local steps per round.

Figures (medians over the co-training rounds after the first, which pays one-time costs):
- phase1_pair_s: the probe exchange of the pair (send one's proxy, receive the other's,
  L1 dissimilarity), as seen by the peer that arrives last (the other one also waits
  for its partner's local epoch);
- phase2_pair_s / phase2_compute_s: one co-training round of the pair (announce, local
  training, upload, aggregation, distribute), the slower peer's wall time and the
  slower peer's time in method code;
- phase2_critical_compute_s: the round's critical path of compute, what its wall time
  would be with free communication. Every exchange waits for all peers' end markers, so
  the compute between two exchanges lasts as long as the slower peer's; the sum over those
  segments (`device.critical_compute_s`), the first one starting with each peer's work
  between rounds (evaluation, the privacy ledger's round bookkeeping: ~15 ms here);
  phase2_round_period_s, the slower peer's time from one round's end to the next (phase 2
  is a sequence of such periods). overhead_fraction = 1 - critical / period is what
  the protocol adds (encoding, framing, TLS, the hand-offs to the transport's thread, the
  transfers). wait_and_overhead_fraction = 1 - compute / wall also counts a peer waiting
  for its partner's longer compute: the aggregator cannot aggregate before the member's
  training is over, which no protocol can remove (with two peers on 2 shared cores, the
  training-time skew alone is about 10% of the round);
- phase1_message_bytes: one probe frame (safetensors) vs raw_tensor_bytes (its tensors);
  phase2_total_bytes: the frames the pair sends per round (both directions);
- peak_rss_mb: the larger peer's peak resident memory (whole process: Python, torch).
Targets on loopback: overhead_fraction <= 0.05; message bytes within 1% of raw bytes.

Link profiles (`--link ethernet|wifi|MBPS[:LATENCY_MS]`, run option `device_link`): every
peer paces what it writes to the link's rate and adds its one-way latency once per batch
(`p4bench_device.link`), as on the Raspberry Pi testbeds (100 Mbit/s Ethernet,
~10 Mbit/s Wi-Fi). The shaped run follows an unshaped one, and `transfers` puts the
measured transfer time of each phase-2 message batch next to the link's capacity:
predicted_s = wire bytes * 8 / rate + latency; measured_s, the sender's time; protocol_s,
the same batch's median time on the unshaped run (encoding, hand-offs between the driver
and the transport's thread, the TLS stream: about 1 ms here, which alone is 10% of an
Ethernet transfer of this model); link_s = measured_s - protocol_s, what the link added.
The target: link_s within 10% of predicted_s (`ratio`; `ratio_total` is measured_s over
predicted_s). The figures at the top level are the shaped run's; `unshaped` keeps the
other's times, and the overhead target (<= 0.05) is always the unshaped run's.

What is measured, so that the two sides are the same thing: with two peers a round's
aggregator A and member B exchange one message each way, `upload` (B's proxy delta to A)
and `distribute` (the new group proxy, A to B); the other side of each exchange sends
only its end marker. A batch is the sender's frames of one exchange (message plus end
marker, all paced: its wire bytes), and its time is the sender's communication time in
that exchange, wall minus compute (encoding, the paced writes, the TLS stream, and
waiting for the partner's end marker), from the round metrics
`device.<peer>.exchange.<name>.{comm_s,wire_bytes_sent,messages_sent}`. The target is on
`distribute`: B sent its end marker as soon as its upload was done, before A had even
aggregated, so A's time is its own transfer alone. `upload` is reported too, but B also
waits there for A's end marker, which A sends only when its local training is over: when
A trains longer than B, the gap counts as B's transfer time (so a ratio above 1 there is
training skew, not the link). A receiver's view would add the sender's compute instead.

`--device-profile rpi4` (run option `device_profile`) holds each peer to a Raspberry Pi
4's 4 CPUs and 4 GiB of address space where the OS allows; what each peer applied is
reported under `device_profile`.
Prints one JSON object on the last line of stdout.

    python bench/device.py [--samples 1250] [--local-steps 40] [--rounds 6] [--link wifi] [--device-profile rpi4]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.hookspecs import hookimpl
from p4bench.run.runner import run
from p4bench_device.link import LinkProfile, compare_transfers, parse_link
from p4bench_device.profile import DEVICE_PROFILES

PAPER = {  # Raspberry Pi 4B, Python 3.11, PyTorch 2.1, linear model, CIFAR-10 (reference p4.md section 9)
    "phase1_message_bytes": 622.82e3,
    "phase2_total_bytes": 1246.57e3,
    "phase1_pair_s": 0.04,
    "phase2_pair_s": 5.27,
    "phase2_compute_s": 4.83,
    "phase1_peak_rss_mb": 72,
    "phase2_peak_rss_mb": 489,
}


class RoundFigures:
    """Observer keeping each round's per-peer device metrics."""

    def __init__(self) -> None:
        self.rounds: list[tuple[str, int, dict[str, float]]] = []

    @hookimpl
    def round_finished(self, run, report):
        self.rounds.append((report.phase, report.round, dict(report.metrics)))


def _per_peer(metrics: dict[str, float], quantity: str) -> list[float]:
    return [
        v
        for k, v in metrics.items()
        if k.startswith("device.") and k.endswith("." + quantity) and k.count(".") == 2
    ]


_EXCHANGE_KEY = re.compile(
    r"^device\.(?P<peer>[^.]+)\.exchange\.(?P<name>.+)\.(?P<key>comm_s|wire_bytes_sent|messages_sent)$"
)
PHASE2_EXCHANGES = ("upload", "distribute")


def exchange_samples(
    rounds: Iterable[dict[str, float]], exchanges: Iterable[str] = PHASE2_EXCHANGES
) -> dict[str, list[tuple[float, float]]]:
    """Per exchange, one (wire bytes, communication seconds) sample per round and sending
    peer: the peers whose `device.<peer>.exchange.<name>.messages_sent` is positive (those
    that only sent an end marker carry no message batch)."""
    wanted = tuple(exchanges)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in wanted}
    for metrics in rounds:
        figures: dict[tuple[str, str], dict[str, float]] = {}
        for key, value in metrics.items():
            match = _EXCHANGE_KEY.match(key)
            if match is not None and match["name"] in samples:
                figures.setdefault((match["name"], match["peer"]), {})[match["key"]] = float(value)
        for (name, _peer), entry in sorted(figures.items()):
            if (
                entry.get("messages_sent", 0) > 0
                and "comm_s" in entry
                and "wire_bytes_sent" in entry
            ):
                samples[name].append((entry["wire_bytes_sent"], entry["comm_s"]))
    return samples


def transfer_figures(
    profile: LinkProfile | None,
    samples: dict[str, list[tuple[float, float]]],
    baseline: dict[str, list[tuple[float, float]]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per exchange: on a shaped link, the measured transfer times next to the link's
    prediction (`compare_transfers`), less the same exchange's median time on the unshaped
    link (`baseline`: the protocol's own part); unshaped, only the measured medians."""
    if profile is not None:
        protocol = {
            name: statistics.median(m for _, m in batch)
            for name, batch in (baseline or {}).items()
            if batch
        }
        return {
            name: compare_transfers(profile, batch, protocol.get(name, 0.0))
            for name, batch in samples.items()
        }
    return {
        name: {
            "batches": len(batch),
            "bytes": statistics.median(n for n, _ in batch) if batch else None,
            "measured_s": statistics.median(m for _, m in batch) if batch else None,
        }
        for name, batch in samples.items()
    }


def measure(args: argparse.Namespace, link: str | None) -> dict[str, Any]:
    """One run of the workload (on `link`, or unshaped): its figures, and the per-exchange
    transfer samples of its steady co-training rounds under "samples"."""
    options: dict[str, Any] = {
        "synthetic_dim": 3072,
        "synthetic_classes": 10,
        "group_size": 2,
        "device_local_peers": 2,
    }
    if link:
        options["device_link"] = link
    if args.device_profile:
        options["device_profile"] = args.device_profile
    config = RunConfig(
        method="p4",
        dataset="synthetic",
        clients=2,
        samples_per_client=args.samples,
        eval_fraction=0.0,
        rounds=args.rounds,
        local_steps=args.local_steps,
        data_rate=args.data_rate,
        noise_multiplier=1.0,
        clip=1.0,
        seed=args.seed,
        runtime="device",
        results_dir=tempfile.mkdtemp(prefix="p4bench-bench-device-"),
        options=options,
    )
    figures = RoundFigures()
    result = run(config, observers=[figures], track=False)
    peers = result.summary["device"]["peers"]
    if result.summary["device"]["dropped"]:
        print(f"warning: peers dropped: {result.summary['device']['dropped']}", file=sys.stderr)

    probe = [p["phases"]["grouping"]["exchanges"]["probe"] for p in peers.values()]
    phase1_pair_s = min(e["wall_s"] for e in probe)
    phase1_message_bytes = probe[0]["frame_bytes_sent"] / probe[0]["messages_sent"]
    raw_tensor_bytes = probe[0]["raw_bytes_sent"] / probe[0]["messages_sent"]

    cotraining = [m for phase, r, m in figures.rounds if phase == "cotraining"]
    steady = cotraining[1:] or cotraining
    walls = [max(_per_peer(m, "wall_s")) for m in steady]
    computes = [max(_per_peer(m, "compute_s")) for m in steady]
    periods = [
        max(w + b for w, b in zip(_per_peer(m, "wall_s"), _per_peer(m, "between_rounds_s")))
        for m in steady
    ]
    critical = [m.get("device.critical_compute_s", float("nan")) for m in steady]
    phase2_pair_s, phase2_compute_s = statistics.median(walls), statistics.median(computes)
    overhead = [1 - c / p for c, p in zip(critical, periods)]
    waiting = [1 - c / w for c, w in zip(computes, walls)]

    rounds = config.rounds
    exchanges = [p["phases"]["cotraining"]["exchanges"] for p in peers.values()]
    per_round = lambda key: sum(e[key] for ex in exchanges for e in ex.values()) / rounds  # noqa: E731
    phase2_total_bytes, phase2_raw_bytes = (
        per_round("frame_bytes_sent"),
        per_round("raw_bytes_sent"),
    )
    peak1 = max(p["phases"]["grouping"]["peak_rss_mb"] for p in peers.values())
    peak2 = max(p["phases"]["cotraining"]["peak_rss_mb"] for p in peers.values())
    samples = exchange_samples(steady)
    if not any(samples.values()):
        print(
            "warning: no per-exchange round metrics (device.<peer>.exchange.<name>.comm_s): "
            "transfer times not measured",
            file=sys.stderr,
        )
    return {
        "link": parse_link(link).to_dict() if link else None,
        "device_profile": {peer: p.get("profile") for peer, p in peers.items()}
        if args.device_profile
        else None,
        "parameters": int(raw_tensor_bytes // 4),
        "samples_per_client": args.samples,
        "local_steps": args.local_steps,
        "rounds": rounds,
        "dp": {"noise_multiplier": 1.0, "clip": 1.0},
        "phase1_pair_s": round(phase1_pair_s, 5),
        "phase2_pair_s": round(phase2_pair_s, 5),
        "phase2_compute_s": round(phase2_compute_s, 5),
        "phase2_overhead_s": round(phase2_pair_s - phase2_compute_s, 5),
        "phase2_round_period_s": round(statistics.median(periods), 5),
        "phase2_critical_compute_s": round(statistics.median(critical), 5),
        "overhead_fraction": round(statistics.median(overhead), 5),
        "overhead_fraction_max": round(max(overhead), 5),
        "wait_and_overhead_fraction": round(statistics.median(waiting), 5),
        "phase1_message_bytes": int(phase1_message_bytes),
        "raw_tensor_bytes": int(raw_tensor_bytes),
        "phase1_bytes_over_raw": round(phase1_message_bytes / raw_tensor_bytes - 1, 6),
        "phase2_total_bytes": int(phase2_total_bytes),
        "phase2_raw_tensor_bytes": int(phase2_raw_bytes),
        "phase2_bytes_over_raw": round(phase2_total_bytes / phase2_raw_bytes - 1, 6),
        "phase2_wire_bytes": int(
            per_round("wire_bytes_sent")
        ),  # frames plus framing headers and end-of-exchange markers
        "phase1_peak_rss_mb": round(peak1, 1),
        "phase2_peak_rss_mb": round(peak2, 1),
        "peak_rss_mb": round(max(peak1, peak2), 1),
        "accuracy_per_client": result.summary["accuracy_per_client"],
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--samples", type=int, default=1250, help="samples per client (80%% for training)"
    )
    parser.add_argument(
        "--local-steps", type=int, default=40, help="local steps K per co-training round"
    )
    parser.add_argument("--rounds", type=int, default=6, help="co-training rounds")
    parser.add_argument(
        "--data-rate", type=float, default=0.2, help="batch = data rate x training samples"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--link",
        default=None,
        help="shape every peer's traffic: ethernet | wifi | MBPS[:LATENCY_MS]; "
        "the run is preceded by an unshaped one (the protocol's own time). Default: unshaped only",
    )
    parser.add_argument(
        "--device-profile",
        default=None,
        choices=sorted(DEVICE_PROFILES),
        help="hold every peer to a device's CPUs and memory where the OS allows",
    )
    args = parser.parse_args(argv)
    try:
        link = parse_link(args.link) if args.link else None
    except UsageError as exc:
        parser.error(str(exc))

    unshaped = measure(args, None)
    shaped = measure(args, args.link) if link is not None else None
    main_run = shaped or unshaped
    baseline = unshaped.pop("samples")
    samples = shaped.pop("samples") if shaped is not None else baseline
    transfers = transfer_figures(link, samples, baseline)
    out = {
        "bench": "device",
        "peers": 2,
        "transport": "TLS over TCP, 127.0.0.1",
        "model": "linear 3072 -> 10",
        **main_run,
        "transfers": transfers,
        "paper_pi": PAPER,
    }
    if shaped is not None:
        out["unshaped"] = {
            k: unshaped[k]
            for k in (
                "phase1_pair_s",
                "phase2_pair_s",
                "phase2_compute_s",
                "phase2_critical_compute_s",
                "overhead_fraction",
                "wait_and_overhead_fraction",
            )
        }
    phase1_ratio, phase2_ratio = out["phase1_bytes_over_raw"], out["phase2_bytes_over_raw"]
    out["targets"] = {
        "overhead_fraction_le_0.05": unshaped["overhead_fraction"]
        <= 0.05,  # the protocol's own share: the unshaped run's
        "message_bytes_within_1pct_of_raw": abs(phase1_ratio) <= 0.01 and abs(phase2_ratio) <= 0.01,
    }
    if (
        link is not None
    ):  # distribute: the sender's time is its transfer alone (see the module docstring)
        out["targets"]["transfer_within_10pct_of_link"] = transfers["distribute"]["within_10pct"]

    print(
        f"phase 1 per pair: {out['phase1_pair_s']:.4f} s (paper, Pi: {PAPER['phase1_pair_s']} s); "
        f"message {out['phase1_message_bytes'] / 1e3:.2f} kB, raw tensors {out['raw_tensor_bytes'] / 1e3:.2f} kB "
        f"(paper, pickled: 622.82 kB)"
    )
    print(
        f"phase 2 per pair: {out['phase2_pair_s']:.4f} s, of which compute {out['phase2_compute_s']:.4f} s, overhead "
        f"{out['overhead_fraction']:.2%} over the critical path's {out['phase2_critical_compute_s']:.4f} s "
        f"({out['wait_and_overhead_fraction']:.2%} with waiting for the partner's compute) "
        f"(paper, Pi: 5.27 s, training "
        f"4.83 s); {out['phase2_total_bytes'] / 1e3:.2f} kB per round (paper: 1246.57 kB)"
    )
    if shaped is not None:
        print(
            f"unshaped: phase 2 per pair {unshaped['phase2_pair_s']:.4f} s, "
            f"overhead {unshaped['overhead_fraction']:.2%}"
        )
    print(
        f"peak memory: {out['phase1_peak_rss_mb']:.0f} MB phase 1, {out['phase2_peak_rss_mb']:.0f} MB phase 2 "
        f"(paper, Pi: 72 MB, 489 MB)"
    )
    for name, t in transfers.items():
        if link is not None and t["batches"]:
            print(
                f"link {link.name} ({link.rate_bits_per_s / 1e6:g} Mbit/s, {link.latency_s * 1e3:g} ms): {name} "
                f"{t['bytes'] / 1e3:.2f} kB in {t['measured_s'] * 1e3:.2f} ms, "
                f"of which the link {t['link_s'] * 1e3:.2f} ms "
                f"(protocol {t['protocol_s'] * 1e3:.2f} ms unshaped); "
                f"capacity predicts {t['predicted_s'] * 1e3:.2f} ms "
                f"(ratio {t['ratio']:.3f}, {t['batches']} batches)"
            )
        elif t["batches"]:
            print(f"unshaped: {name} {t['bytes'] / 1e3:.2f} kB in {t['measured_s'] * 1e3:.2f} ms")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
