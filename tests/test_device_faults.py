"""Faults and attacks on the device runtime, with real peer processes on 127.0.0.1: a
connection flood during a run, a compromised peer injecting wrong-layout messages, an
authenticated push to an idle peer, and peers that keep serving across runs.
(Transport-level cases, one process: tests/test_device_hardening.py.)"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from p4bench.config import RunConfig
from p4bench.hookspecs import hookimpl
from p4bench.run.runner import run
from p4bench_device.launcher import LocalPeers

FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}
SEEDED = {"noise_source": "seeded", "device_simulation": True}  # results equal the simulator's


def _device_config(cluster: LocalPeers, results_dir: str, **changes) -> RunConfig:
    options = {
        "device_peers": str(cluster.peers_path),
        "device_tls_dir": str(cluster.tls_dir),
        **FAST,
        **changes.pop("options", {}),
    }
    base = dict(
        method="p4",
        clients=cluster.clients,
        rounds=6,
        local_steps=2,
        seed=4,
        eval_fraction=0.0,
        runtime="device",
        results_dir=results_dir,
        options=options,
        **SEEDED,
    )
    base.update(changes)
    return RunConfig(**base)


def _simulated(config: RunConfig) -> dict:
    options = {k: v for k, v in config.options.items() if not k.startswith("device_")}
    plain = config.replace(
        runtime="simulation", options=options, noise_source="auto", device_simulation=False
    )
    return run(plain, track=False).summary


class Flood:
    """`count` plain TCP sockets (no TLS, never sending) opened at `port` and held, those
    the peer closes reopened, from `start()` until `stop` is set (bounded by `limit_s`)."""

    def __init__(self, port: int, count: int = 300, limit_s: float = 120.0) -> None:
        self.port, self.count, self.limit_s = port, count, limit_s
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.opened = 0

    def start(self) -> None:
        self.thread = threading.Thread(target=self._flood, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)

    def _flood(self) -> None:
        held: list[socket.socket] = []
        deadline = time.monotonic() + self.limit_s
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                held = [s for s in held if _still_open(s)]
                while len(held) < self.count:
                    try:
                        held.append(socket.create_connection(("127.0.0.1", self.port), timeout=5))
                        self.opened += 1
                    except OSError:
                        break
                self.stop.wait(0.2)
        finally:
            for s in held:
                s.close()


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # the peer only ever closes these
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_connection_flood_during_a_run_drops_no_peer(tmp_path):
    with LocalPeers(4) as cluster:
        flood = Flood(cluster.peers.by_id["1"].port)
        config = _device_config(cluster, str(tmp_path))
        flood.start()  # from before the launcher connects to the end of the run
        try:
            result = run(config, track=False)
        finally:
            flood.finish()
    device = result.summary["device"]
    assert flood.opened >= 300
    assert device["dropped"] == [] and device["absences"] == [], (
        device["dropped"],
        device["absences"][:3],
    )
    transport = device["peers"]["1"]["transport"]
    seen = {**transport.get("rejected_before_run", {}), **transport["rejected"]}
    assert sum(n for reason, n in seen.items() if "handshake" in reason) > 0, (
        transport
    )  # the flood was there
    simulated = _simulated(config)
    for client, accuracy in simulated["accuracy_per_client"].items():
        assert abs(result.summary["accuracy_per_client"][client] - accuracy) <= 1e-4


# A peer whose process is compromised: besides its honest messages it sends three messages
# of a wrong payload layout to every other peer in every exchange (valid frames, its own
# source and the right destination: only the layout check can tell).
COMPROMISED = r"""
import torch
from p4bench.engine.messages import Messages, encode
from p4bench_device import network

honest = network.TLSNetwork._frames

def frames(self, exchange, round_index, outgoing):
    own, out, sizes, raw = honest(self, exchange, round_index, outgoing)
    for node, peer in self.peer_of.items():
        if peer != self.me.id:
            junk = Messages(torch.tensor([self.me.node]), torch.tensor([node]), {"update.weight": torch.zeros(1, 7)})
            out.setdefault(peer, []).extend(encode(exchange, round_index, junk) for _ in range(3))
    return own, out, sizes, raw

network.TLSNetwork._frames = frames
from p4bench_device.cli import main
main()
"""


class OneCompromised(LocalPeers):
    def command(self, spec):
        argv = super().command(spec)
        return [sys.executable, "-c", COMPROMISED, *argv[3:]] if spec.id == "3" else argv


def test_a_compromised_peer_is_rejected_alone_and_the_run_holds(tmp_path):
    with OneCompromised(4) as cluster:
        config = _device_config(cluster, str(tmp_path))
        result = run(config, track=False)
    device = result.summary["device"]
    assert device["dropped"] == []
    for peer in ("0", "1", "2"):
        rejected = device["peers"][peer]["transport"]["rejected"]
        # its junk comes on top of its one honest message per exchange: rejected as extra messages
        # before it is buffered (and peer 3 dropped for them), or by its layout; only peer 3 is named
        named = {
            reason: n
            for reason, n in rejected.items()
            if reason.startswith(("payload layout", "extra message"))
        }
        assert (
            set(named) <= {"payload layout from 3", "extra message from 3"}
            and sum(named.values()) > 0
        ), rejected
        assert device["peers"][peer]["receive_errors"] == 0
    honest = [str(c) for c in range(3)]
    attacked = np.mean([result.summary["accuracy_per_client"][c] for c in honest])
    clean = np.mean([_simulated(config)["accuracy_per_client"][c] for c in honest])
    print(
        f"honest clients' mean accuracy {attacked:.4f} attacked vs {clean:.4f} clean; "
        f"peer 0 rejected {device['peers']['0']['transport']['rejected']}"
    )
    assert abs(attacked - clean) <= 0.02, (attacked, clean)


def _bench(name: str):
    """A module of bench/ (its helpers: the same push here and in its measurement)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_an_authenticated_push_to_an_idle_peer_is_survived_and_a_huge_frame_refused():
    """Behaviour only: the idle peer stays up through 192 MiB pushed with a valid key and
    refuses a 512 MiB length field before reading it. What the push costs its memory is a
    figure of bench/device_push.py (a loaded machine moves it), not asserted here."""
    bench = _bench("device_push")
    with LocalPeers(2) as cluster:
        port = cluster.peers.by_id["0"].port
        bench.wait_listening(port)
        pushed = bench.push(port, cluster.tls_dir)
        assert bench.refuses_a_huge_frame(port, cluster.tls_dir)
        assert pushed > 0 and cluster.processes["0"].poll() is None
        cluster.processes["0"].terminate()
        cluster.processes["1"].terminate()


def test_peers_keep_serving_across_runs_with_counters_per_run(tmp_path):
    with LocalPeers(2, keep_serving=True) as cluster:
        config = _device_config(
            cluster, str(tmp_path), rounds=2, local_steps=1, options={"group_size": 2}
        )
        first = run(config, track=False).summary
        assert all(
            p.poll() is None for p in cluster.processes.values()
        )  # still serving after the launcher's stop
        second = run(config.replace(seed=5), track=False).summary
        for summary in (first, second):
            assert summary["device"]["dropped"] == [] and all(
                p["finished"] for p in summary["device"]["peers"].values()
            )
        for seed, summary in ((4, first), (5, second)):
            simulated = _simulated(config.replace(seed=seed))
            for client, accuracy in simulated["accuracy_per_client"].items():
                assert abs(summary["accuracy_per_client"][client] - accuracy) <= 1e-4
        # the second run's transport counters are its own, not a running total
        for peer in ("0", "1"):
            one, two = (
                first["device"]["peers"][peer]["transport"],
                second["device"]["peers"][peer]["transport"],
            )
            assert 0 < two["frames_received"] <= one["frames_received"] * 1.5, (one, two)
        for process in cluster.processes.values():
            process.terminate()


# A peer that withholds its end markers: it sends its messages to every other peer but never
# the marker that closes its batch, so every receiver waits for it until the exchange timeout.
WITHHOLDER = r"""
from p4bench_device import admission
from p4bench_device.protocol import KIND_END

honest = admission.FrameConnection.send

async def send(self, frames, timeout, shaper=None):
    return await honest(self, [f for f in frames if f[0] != KIND_END], timeout, shaper)

admission.FrameConnection.send = send
from p4bench_device.cli import main
main()
"""


class OneWithholder(LocalPeers):
    def command(self, spec):
        argv = super().command(spec)
        return [sys.executable, "-c", WITHHOLDER, *argv[3:]] if spec.id == "3" else argv


def test_a_peer_withholding_its_end_markers_is_dropped_as_slow_and_the_run_completes(tmp_path):
    rounds = []
    with OneWithholder(4) as cluster:
        config = _device_config(cluster, str(tmp_path), options={"device_exchange_timeout_s": 4})
        result = run(config, observers=[_Rounds(rounds)], track=False)
    device = result.summary["device"]
    assert device["dropped"] == [] and all(
        p["finished"] for p in device["peers"].values()
    )  # the run completed
    by = {e["by"] for e in device["slow_dropped"] if e["peer"] == "3"}
    assert by == {"0", "1", "2"} and {e["peer"] for e in device["slow_dropped"]} == {"3"}, device[
        "slow_dropped"
    ]
    assert all(
        "dropped slow peer 3" in e["message"] and "no end marker" in e["reason"]
        for e in device["slow_dropped"]
    )
    for peer in ("0", "1", "2"):
        transport = device["peers"][peer]["transport"]
        assert [e["peer"] for e in transport["slow_dropped"]] == ["3"] and transport["refused"] == [
            "3"
        ]
    # dropped after K = 2 exchanges in which it was expected: announced in the round metrics from then on
    assert (
        rounds[-1]["device.slow_peers_dropped"] == 1 and rounds[-1]["device.3.slow_dropped_by"] == 3
    )
    assert rounds[0].get("device.slow_peers_dropped", 0) == 0
    honest = [str(c) for c in range(3)]
    assert all(np.isfinite(result.summary["accuracy_per_client"][c]) for c in honest)


class _Rounds:
    """Observer: each round's metrics."""

    def __init__(self, into: list) -> None:
        self.into = into

    @hookimpl
    def round_finished(self, run, report):
        self.into.append(dict(report.metrics))
