"""One peer of a device run: `p4bench device serve`.

A peer holds one client's row (or, for server-based methods, the server) and runs the
method's phases, rounds and steps in lockstep with the other peers with the engine's
`RoundDriver`, the very driver every runtime uses. Only the network it hands the
driver differs: messages go out as safetensors frames over TLS and come back from the
other peers (`network.TLSNetwork` over `transport`).

A peer is a separate party: its client's private draws (DP noise, Poisson batches, the
peers it samples) come from its own secret source (`p4bench.rng.SecretRng`), never from
the run seed that every peer receives, so no peer can subtract another's noise. Only a
run marked `device_simulation` with `noise_source: seeded` uses the seeded streams (then
the numbers agree with the simulator's, and the run's epsilon is uncertified); a peer
refuses seeded randomness without that mark.

The peer builds its data itself, from the dataset on its own disk, with the run's
seed, partitioner and client id (`p4bench.run.runner.prepare`); raw data never crosses
the network. Only the config goes in, and only reports (accuracy, measurements) and
the final model state go out to the launcher.

Nothing a peer receives can crash it: frames are validated by the transport; a sender
whose messages disagree with the exchange's payload layout (the method's declaration,
or this peer's own messages; never a vote) has its messages of the exchange dropped; and if the method's
`receive` still fails on what arrived, the error is logged and counted and the peer
goes on with its own messages only.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save as st_save

from p4bench.engine.driver import ClientGroup, RoundDriver
from p4bench.engine.messages import PROTOCOL_VERSION
from p4bench.engine.runtime import Job
from p4bench.engine.state import flatten
from p4bench.errors import UsageError
from p4bench.records import Release, RoundReport
from p4bench.rng import SERVER_ID
from p4bench_device.link import LinkShaper, parse_link
from p4bench_device.measure import PowerMeter
from p4bench_device.network import TLSNetwork
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.profile import apply_device_profile
from p4bench_device.protocol import Limits
from p4bench_device.transport import PeerTransport

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.host.manager import Registry
    from p4bench.privacy.ledger import PrivacyLedger

log = logging.getLogger("p4bench.device")

__all__ = ["DeviceNode", "serve", "peer_config"]


class Aborted(Exception):
    """The launcher stopped the run."""


class DeviceNode:
    """One peer of a device run: the engine's `RoundDriver` holding this peer's client
    (or only the server, on the server's peer), exchanging over a `TLSNetwork`, and
    reporting every round to the launcher."""

    def __init__(
        self,
        me: PeerSpec,
        peers: PeersFile,
        transport: PeerTransport,
        meter: PowerMeter | None = None,
        profile: dict[str, Any] | None = None,
    ) -> None:
        self.me, self.peers, self.transport = me, peers, transport
        self.profile = profile  # the device profile applied to this process (recorded in the run)
        self.network = TLSNetwork(me, peers, transport, meter)
        self.releases: list[dict[str, Any]] = []
        self.ledger: PrivacyLedger | None = None
        self.driver: RoundDriver | None = None
        # The launcher's time budget: stop after this step (its "finish" message); this
        # peer never reads a clock of its own, so that every peer stops after the same round.
        self.finish_after: int | None = None
        self.last_step = 0  # rounds finished so far, over all phases

    @property
    def is_server(self) -> bool:
        return self.me.node == SERVER_ID

    @property
    def groups(self) -> list[ClientGroup]:
        return self.driver.groups if self.driver is not None else []

    def setup(self, job: Job, ledger: PrivacyLedger | None = None) -> None:
        """Build this peer's client state (or the server's) for `job`."""
        self.job, self.ledger = job, ledger
        job.report_release = self._record_release
        rows = [] if self.is_server else [torch.tensor([self.me.node])]
        self.driver = RoundDriver(
            job, self.network, rows, holds_server=self.is_server, separate_parties=True
        )
        self.network.attach(job)  # its method, and whether this peer holds its sends back

    def _record_release(self, release: Release) -> None:
        if self.ledger is not None:  # this peer's own budget decisions need its history
            self.ledger.record_release(release)
        settings = (
            self.job.dp
        )  # the clip is this peer's setting, checked by the launcher against its own
        self.releases.append(
            {
                "clients": [int(c) for c in release.clients],
                "sample_rate": float(release.sample_rate),
                "noise_multiplier": float(release.noise_multiplier),
                "steps": int(release.steps),
                "phase": str(release.phase),
                "clip": float(settings.clip) if settings is not None else None,
            }
        )

    def run(self) -> None:
        """The run's schedule through the driver; one report to the launcher per round and
        per setup, then the final one with this client's state."""
        assert self.driver is not None, "setup() first"
        outcome = self.driver.run(
            on_round=lambda report: self._report("round", report),
            on_setup=lambda report: self._report("setup", report),
            stop_after=self._finish_requested,
        )
        state = None
        if self.groups:
            flat = {
                k: v.detach().contiguous().clone()
                for k, v in flatten(self.groups[0].state, sep="/").items()
            }
            state = st_save(
                flat, metadata={"p4bench_protocol": PROTOCOL_VERSION, "node": str(self.me.node)}
            )
        self.transport.report(
            {
                "type": "final",
                "node": self.me.node,
                **self._accuracy_fields(outcome.accuracy, outcome.extra_accuracy),
                "receive_errors": self.driver.receive_errors,
                "transport": self.transport.snapshot(),
                "stopped_after_step": self.last_step,
                "finish_after": self.finish_after,
                "profile": self.profile,
                "link": self.transport.shaper.figures()
                if self.transport.shaper is not None
                else None,
            },
            state,
        )

    def _finish_requested(self, step: int) -> bool:
        """The driver's `stop_after`: the launcher asked every peer to stop after a step."""
        return self.finish_after is not None and step >= self.finish_after

    def _report(self, kind: str, report: RoundReport) -> None:
        assert self.driver is not None
        figures = dict(self.network.figures)
        figures["eval_s"] = (
            time.perf_counter() - self.network.steps_done_at
        )  # the driver evaluated since
        releases, self.releases = self.releases, []
        losses = report.losses if report.losses is not None else np.zeros(0)
        send = (
            self.transport.report_later if kind == "round" else self.transport.report
        )  # a round's: off the critical path
        send(
            {
                "type": kind,
                "node": self.me.node,
                "phase": report.phase,
                "round": report.round,
                **self._accuracy_fields(report.accuracy, report.extra_accuracy),
                "losses": [float(x) for x in losses],
                "bytes_sent": int(report.bytes_sent),
                "node_bytes_sent": int(report.bytes_sent),
                "node_bytes_received": int(report.bytes_received),
                "measure": figures,
                "releases": releases,
                "absent": self.network.absences,
                "slow_dropped": self.network.slow_dropped,  # senders this peer dropped as slow (`liveness`)
                "receive_errors": self.driver.receive_errors,
                # the method's counters of this peer (ctx.metrics); the launcher adds them over peers
                "metrics": {str(k): float(v) for k, v in report.metrics.items()},
            }
        )
        if kind == "round":
            self.last_step = report.step
            if self.ledger is not None:  # rounds elapsed matter to some accountants' budgets
                reported = np.zeros(self.job.data.num_clients, dtype=bool)
                if not self.is_server:
                    reported[self.me.node] = True
                self.ledger.end_round(report.phase, report.round, reported)
            self._poll_control()

    @staticmethod
    def _accuracy_fields(accuracy: np.ndarray, extra: dict[str, np.ndarray]) -> dict[str, Any]:
        if not len(accuracy):
            return {"accuracy": None, "extra": {}}
        return {"accuracy": float(accuracy[0]), "extra": {k: float(v[0]) for k, v in extra.items()}}

    def _poll_control(self) -> None:
        while not self.transport.control.empty():
            message = self.transport.control.get_nowait()
            if message.get("type") == "stop":
                raise Aborted("the launcher stopped the run")
            if message.get("type") == "launcher-closed":
                log.warning("the launcher disconnected; finishing the run for the other peers")
            step = message.get("after_step")
            if (
                message.get("type") == "finish"
                and isinstance(step, int)
                and not isinstance(step, bool)
                and step >= 1
            ):
                self.finish_after = (
                    step if self.finish_after is None else min(self.finish_after, step)
                )
                if (
                    step < self.last_step
                ):  # the launcher's margin was too short: stop now (the launcher logs it)
                    log.warning("finish after step %d arrived after step %d", step, self.last_step)


# -- the serve loop -------------------------------------------------------------------------
def _parse_start(start: dict[str, Any], peers: PeersFile) -> tuple[dict[str, Any], Limits, str]:
    if (
        not isinstance(start.get("config"), dict)
        or not isinstance(start.get("peers"), dict)
        or not isinstance(start.get("limits"), dict)
    ):
        raise UsageError("start message lacks config, peers or limits")
    theirs = PeersFile.parse(start["peers"], "the launcher's peers")
    if sorted((p.id, p.node) for p in theirs.peers) != sorted((p.id, p.node) for p in peers.peers):
        raise UsageError(
            "the launcher's peers (ids and clients) differ from this peer's peers file"
        )
    return start["config"], Limits.from_dict(start["limits"]), str(start.get("run_id", ""))


def peer_config(config: RunConfig) -> RunConfig:
    """The config as this peer runs it: `auto` randomness resolved to `secure` in a
    private run (a peer is a separate party), `seeded` in a non-private one (its draws
    protect nothing, and the numbers then agree with the simulator's); seeded randomness
    in a private run refused unless the run is marked a simulation on devices
    (`device_simulation`), since every peer could then recompute the others' noise and
    batches from the seed. (`prepare` does the same for the device runtime;
    this holds whatever runtime the launcher's config names.)"""
    if (
        config.noise_source == "auto"
    ):  # a non-private run protects nothing with its draws: seeded, as simulated
        config = config.replace(noise_source="secure" if config.private else "seeded")
    if config.noise_source == "seeded" and config.private and not config.device_simulation:
        raise UsageError(
            "seeded noise and batches on devices let every peer recompute the others' noise; "
            "use --noise-source secure, or mark the run --device-simulation (epsilon uncertified)"
        )
    return config


def run_session(
    transport: PeerTransport,
    me: PeerSpec,
    peers: PeersFile,
    start: dict[str, Any],
    meter: PowerMeter | None,
    registry: Registry | None = None,
    profile: dict[str, Any] | None = None,
) -> None:
    """One run: build the data and method from the config, wait for `go`, execute, report."""
    from p4bench.config import RunConfig
    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.run.runner import prepare

    try:
        config_values, limits, run_id = _parse_start(start, peers)
        transport.limits = limits
        transport.begin_run(run_id)
        link = start.get("link")
        transport.shaper = LinkShaper(parse_link(str(link))) if link else None
        config = peer_config(RunConfig(**config_values))
        # stray global-RNG uses (there should be none) must not be predictable from the seed either
        torch.manual_seed(config.seed if config.noise_source == "seeded" else secrets.randbits(63))
        prepared = prepare(config, registry or Registry(create_plugin_manager()))
        if prepared.job.data.num_clients != peers.num_clients:
            raise UsageError(
                f"the run has {prepared.job.data.num_clients} clients, the peers file {peers.num_clients}"
            )
        node = DeviceNode(me, peers, transport, meter, profile)
        node.setup(prepared.job, prepared.ledger)
        # buffer caps scale with what this run's messages can hold: the model's bytes
        transport.set_model_bytes(
            sum(p.numel() * p.element_size() for p in prepared.job.method.initial_params().values())
        )
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which stops the run
        log.exception("cannot start the run")
        transport.report(
            {"type": "error", "node": me.node, "message": f"{type(exc).__name__}: {exc}"[:2000]}
        )
        return
    log.info("run %s: node %d ready", run_id, me.node)
    transport.report({"type": "ready", "node": me.node})
    deadline = time.monotonic() + limits.startup_timeout_s
    while True:
        try:
            message = transport.control.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            log.error("no go from the launcher within %.0f s", limits.startup_timeout_s)
            return
        kind = message.get("type")
        if kind == "go":
            break
        if kind == "stop":
            return
        if (
            kind == "launcher-closed"
        ):  # during start-up the launcher connects again (until the deadline)
            log.warning("the launcher disconnected before go; waiting for it to reconnect")
        elif (
            kind == "start" and str(message.get("run_id", "")) == run_id
        ):  # it reconnected: our ready may be lost
            transport.report({"type": "ready", "node": me.node})
        elif kind == "start":
            log.warning(
                "start of another run (%s) while run %s waits for go; ignored",
                message.get("run_id"),
                run_id,
            )
    try:
        node.run()
    except Aborted:
        log.warning("run %s stopped by the launcher", run_id)
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("run failed")
        transport.report(
            {"type": "error", "node": me.node, "message": f"{type(exc).__name__}: {exc}"[:2000]}
        )
        return
    log.info("run %s: node %d finished", run_id, me.node)


def serve(
    peer_id: str,
    listen: str,
    peers_path: str,
    tls_dir: str,
    power: str | None = None,
    power_interval: float = 1.0,
    threads: int | None = None,
    keep_serving: bool = False,
    idle_timeout: float | None = None,
    device_profile: str | None = None,
) -> None:
    """Listen for the launcher and the other peers; run one run and exit when the launcher
    says stop, or with `keep_serving` serve one run after another (the launcher's stop ends
    a run, not the peer), until `idle_timeout` seconds pass without a run to start.
    `device_profile` limits this process like a device (CPUs, address space) first."""
    peers = PeersFile.load(peers_path)
    me = peers.get(peer_id, peers_path)
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen expects HOST:PORT, got {listen!r}")
    if threads:
        torch.set_num_threads(int(threads))
    profile = None
    if (
        device_profile
    ):  # after --threads (it may lower them); peers sharing a host take separate blocks of CPUs
        profile = apply_device_profile(
            device_profile, slot=[p.id for p in peers.peers if p.host == me.host].index(me.id)
        )
    meter = PowerMeter(power, power_interval) if power else None
    transport = PeerTransport(me, peers, tls_dir, Limits())
    try:
        bound = transport.start(host.strip("[]") or "0.0.0.0", int(port))
        print(
            f"p4bench device peer {peer_id} (node {me.node}) listening on {host}:{bound}",
            flush=True,
        )
        registry = _warm_up()
        if meter is not None:
            meter.start()
        while True:
            try:
                message = transport.control.get(timeout=idle_timeout)
            except queue.Empty:
                log.warning("no run started within %.0f s; exiting", idle_timeout)
                return
            kind = message.get("type")
            if kind == "start":
                try:
                    run_session(transport, me, peers, message, meter, registry, profile)
                finally:
                    transport.end_run()  # nothing of a run stays buffered, nothing is accepted until the next
                    transport.shaper = None
                if not keep_serving:
                    _wait_for_stop(transport)
                    return
                log.info("run over; serving the next run (--keep-serving)")
            elif kind == "stop" and not keep_serving:
                return
    finally:
        if meter is not None:
            meter.stop()
        transport.close()


def _warm_up() -> Registry:
    """While waiting for the launcher: load every plugin and torch's lazily imported
    gradient machinery, so the run does not wait for them (no effect on results).
    Returns the plugin registry runs are prepared with."""
    from torch.func import grad, vmap

    from p4bench.host.manager import Registry, create_plugin_manager

    registry = Registry(create_plugin_manager())
    vmap(grad(lambda w, x: (w * x).sum()), in_dims=(0, 0))(torch.zeros(1, 2), torch.ones(1, 2))
    return registry


def _wait_for_stop(transport: PeerTransport) -> None:
    """Stay reachable until the launcher has collected every peer's results."""
    deadline = time.monotonic() + transport.limits.round_timeout_s
    while time.monotonic() < deadline:
        try:
            message = transport.control.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            return
        if message.get("type") in ("stop", "launcher-closed"):
            return
