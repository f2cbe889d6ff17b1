"""One peer of a device run: `p4bench device serve`.

A peer holds one client's row (or, for server-based methods, the server) and runs the
method's phases, rounds and steps in lockstep with the other peers, exactly as the
simulator's `GroupedRuntime` does for a group of one client: the same method code. Only
the exchanges differ: messages go out as safetensors frames over TLS and come back from
the other peers (see `transport`).

A peer is a separate party: its client's private draws (DP noise, Poisson batches, the
peers it samples) come from its own secret source (`p4bench.rng.SecretRng`), never from
the run seed that every peer receives, so no peer can subtract another's noise. Only a
run marked `device_simulation` with `noise_source: seeded` uses the seeded streams (then
the numbers agree with the simulator's, and the run's epsilon is uncertified); a peer
refuses seeded randomness without that mark.

The peer builds its data itself, from the dataset on its own disk, with the run's
seed, partitioner and client id (`p4bench.runner.prepare`); raw data never crosses
the network. Only the config goes in, and only reports (accuracy, measurements) and
the final model state go out to the launcher.

Nothing a peer receives can crash it: frames are validated by the transport; messages
whose payload layout disagrees with this exchange's are dropped; and if the method's
`receive` still fails on what arrived, the error is logged and counted and the peer
goes on with its own messages only.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from collections import Counter
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save as st_save

from p4bench.engine.messages import PROTOCOL_VERSION, Messages, encode
from p4bench.engine.method import Phase
from p4bench.engine.runtime import STREAM_TRAINING, GroupedRuntime, Job
from p4bench.engine.state import flatten
from p4bench.engine.threats import Aggregator
from p4bench.engine.training import batched_loss_and_grad
from p4bench.errors import UsageError
from p4bench.plugins.device.measure import PowerMeter, RoundClock
from p4bench.plugins.device.peers import PeersFile, PeerSpec
from p4bench.plugins.device.protocol import Limits
from p4bench.plugins.device.transport import PeerTransport
from p4bench.rng import SERVER_ID, client_rng, secret_draws

if TYPE_CHECKING:
    from p4bench.config import RunConfig

log = logging.getLogger("p4bench.device")

__all__ = ["DeviceNode", "serve", "consistent_messages", "peer_config"]


class Aborted(Exception):
    """The launcher stopped the run."""


def payload_schema(message: Messages) -> tuple:
    """(key, dtype, per-message shape) of every payload tensor."""
    return tuple(sorted((k, str(v.dtype), tuple(v.shape[1:])) for k, v in message.payload.items()))


def consistent_messages(own: list[Messages], received: list[Messages]) -> tuple[list[Messages], list[Messages]]:
    """(kept, dropped): received messages whose payload layout matches this exchange's.

    The layout is that of this node's own messages in the exchange when it sent any
    (every node runs the same method), else the most common one among those received
    (ties: the earliest)."""
    if not received:
        return [], []
    schemas = [payload_schema(m) for m in received]
    if own:
        reference = payload_schema(own[0])
    else:
        counts = Counter(schemas)
        reference = max(counts, key=lambda s: (counts[s], -schemas.index(s)))
    kept = [m for m, s in zip(received, schemas) if s == reference]
    dropped = [m for m, s in zip(received, schemas) if s != reference]
    return kept, dropped


class DeviceNode(GroupedRuntime):
    """The driver of one peer: a `GroupedRuntime` whose only group is this peer's
    client (or none, on the server's peer), with exchanges over the transport."""

    name = "device-node"
    separate_parties = True

    def __init__(self, me: PeerSpec, peers: PeersFile, transport: PeerTransport, meter: PowerMeter | None = None) -> None:
        self.me, self.peers, self.transport, self.meter = me, peers, transport, meter
        self.peer_of = {p.node: p.id for p in peers.peers}
        self.others = {p.id for p in peers.peers if p.id != me.id}
        self.seq = 0
        self.absent_round: set[str] = set()
        self.absences: list[dict[str, Any]] = []
        self.receive_errors = 0
        self.releases: list[dict[str, Any]] = []
        self.clock = RoundClock()
        self.ledger = None

    @property
    def is_server(self) -> bool:
        return self.me.node == SERVER_ID

    # -- setup (mirrors GroupedRuntime.execute for this node's rows) -------------------
    def setup(self, job: Job, ledger=None) -> None:
        method, config = job.method, job.config
        self.job, self.ledger = job, ledger
        self.aggregator = Aggregator(job.defense)
        self._loss_and_grad = partial(batched_loss_and_grad, job.model)
        count = job.data.num_clients
        self._malicious = job.malicious if job.malicious is not None else torch.zeros(count, dtype=torch.bool)
        job.report_release = self._record_release
        self.groups = [] if self.is_server else [self._make_group(torch.tensor([self.me.node]))]
        server_rows = torch.tensor([SERVER_ID])
        secret = secret_draws(config.noise_source, self.separate_parties)  # the server peer is a party too
        self.server_rng = client_rng(config.seed, server_rows, STREAM_TRAINING, secret)
        self.server_state = (
            method.init_server_state(self._context(server_rows, self.server_rng, "init", -1)) if self.is_server else {}
        )

    def _record_release(self, release) -> None:
        if self.ledger is not None:  # this peer's own budget decisions need its history
            self.ledger.privacy_release(run=None, release=release)
        self.releases.append(
            {"clients": [int(c) for c in release.clients], "sample_rate": float(release.sample_rate),
             "noise_multiplier": float(release.noise_multiplier), "steps": int(release.steps), "phase": str(release.phase)}
        )

    # -- the schedule ---------------------------------------------------------------------
    def run(self) -> None:
        """Every phase, round and step; one report to the launcher per round."""
        method = self.job.method
        for phase in method.phases():
            self._node_sent = self._node_received = 0
            self._round_losses = []
            if phase.setup:
                self._round("setup", phase, -1, phase.setup)
            for round_index in range(phase.rounds):
                if round_index:
                    self._node_sent = self._node_received = 0
                self._round("round", phase, round_index, method.round_steps(phase, round_index))
                self._poll_control()
        accuracy, extra = self.evaluate() if self.groups else (np.zeros(0), {})
        state = None
        if self.groups:
            flat = {k: v.detach().contiguous().clone() for k, v in flatten(self.groups[0].state, sep="/").items()}
            state = st_save(flat, metadata={"p4bench_protocol": PROTOCOL_VERSION, "node": str(self.me.node)})
        self.transport.report(
            {"type": "final", "node": self.me.node, **self._accuracy_fields(accuracy, extra),
             "receive_errors": self.receive_errors, "transport": self.transport.snapshot()},
            state,
        )

    def _round(self, kind: str, phase: Phase, round_index: int, steps) -> None:
        self.transport.new_round()
        self.absent_round = set()
        self._round_losses = []
        self._exchange_absent: list[dict[str, Any]] = []
        before = self.transport.snapshot()
        self.clock = RoundClock()
        sent = self._run_steps(steps, phase, round_index)
        figures = self.clock.finish(self.meter)
        evaluated = time.perf_counter()
        accuracy, extra = self.evaluate() if self.groups and kind == "round" else (np.zeros(0), {})
        figures["eval_s"] = time.perf_counter() - evaluated
        after = self.transport.snapshot()
        for key in ("wire_bytes_sent", "wire_bytes_received"):
            figures[key] = int(after.get(key, 0) - before.get(key, 0))
        losses = torch.cat(self._round_losses).tolist() if self._round_losses else []
        releases, self.releases = self.releases, []
        self.transport.report({
            "type": kind, "node": self.me.node, "phase": phase.name, "round": round_index,
            **self._accuracy_fields(accuracy, extra),
            "losses": [float(x) for x in losses], "bytes_sent": int(sent),
            "node_bytes_sent": int(self._node_sent), "node_bytes_received": int(self._node_received),
            "measure": figures, "releases": releases, "absent": self._exchange_absent,
            "receive_errors": self.receive_errors,
        })
        if self.ledger is not None and kind == "round":  # rounds elapsed matter to some accountants' budgets
            reported = np.zeros(self.job.data.num_clients, dtype=bool)
            reported[self.me.node] = True
            self.ledger.round_finished(run=SimpleNamespace(reported=reported),
                                       report=SimpleNamespace(phase=phase.name, round=round_index, metrics={}))

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

    def _local_update(self, group, phase: Phase, round_index: int) -> None:
        with self.clock.compute():
            super()._local_update(group, phase, round_index)

    def _server_context(self, phase: Phase, round_index: int):
        return self._context(torch.tensor([SERVER_ID]), self.server_rng, phase.name, round_index)

    # -- one exchange over the network -----------------------------------------------------
    def _exchange(self, exchange: str, phase: Phase, round_index: int) -> int:
        method = self.job.method
        self.seq += 1
        started, computed = time.perf_counter(), self.clock.compute_s
        with self.clock.compute():  # as GroupedRuntime._exchange, for this node's rows (attacks included)
            parts = self._group_outgoing(exchange, phase, round_index)
            if self.is_server:
                parts.append(method.server_outgoing(exchange, self.server_state, self._server_context(phase, round_index)))
            outgoing = Messages.concat(parts)

        own, frames = [], {}
        sent = sent_raw = 0
        for message in outgoing.split() if len(outgoing) else []:
            destination = int(message.dst[0])
            if destination == self.me.node:
                own.append(message)  # a node does not send to itself over the network
                continue
            peer = self.peer_of.get(destination)
            if peer is None:
                log.error("exchange %s: message to node %d, which no peer holds; dropped", exchange, destination)
                continue
            frame = encode(exchange, round_index, message)
            frames.setdefault(peer, []).append(frame)
            sent += len(frame)
            sent_raw += int(message.payload_nbytes()[0])

        marker = {"exchange": exchange, "round": round_index, "phase": phase.name}
        result = self.transport.exchange(self.seq, frames, marker, self.others - self.absent_round, set(self.others))

        received, received_bytes, received_raw = [], 0, 0
        for peer in sorted(result.received):
            their_marker, items = result.received[peer]
            if (their_marker["exchange"], their_marker["round"], their_marker["phase"]) != (exchange, round_index, phase.name):
                self.transport.rejects.reject("out of step", peer, f"marker {their_marker} during {phase.name}/{round_index}/{exchange}")
                result.absent.add(peer)
                continue
            if their_marker["count"] != len(items):
                log.warning("exchange %s: %d of %d messages from %s were valid", exchange, len(items), their_marker["count"], peer)
            for got_exchange, got_round, message, nbytes in items:
                if (got_exchange, got_round) != (exchange, round_index):
                    self.transport.rejects.reject("out of step", peer, f"message for {got_exchange}/{got_round}")
                    continue
                received.append((message, nbytes))
        kept, dropped = consistent_messages(own, [m for m, _ in received])
        for message in dropped:
            self.transport.rejects.reject("payload layout", str(int(message.src[0])), f"{payload_schema(message)} in {exchange}")
        kept_ids = {id(m) for m in kept}
        for message, nbytes in received:
            if id(message) in kept_ids:
                received_bytes += nbytes
                received_raw += int(message.payload_nbytes()[0])
        delivered = Messages.concat(own + kept).sorted()

        with self.clock.compute():
            foreign = len(kept) > 0
            for group in self.groups:
                inbox = delivered.select(torch.isin(delivered.dst, group.rows))
                ctx = self._context(group.rows, group.rng, phase.name, round_index, group.dp)
                state = self._safe_receive(lambda box: method.receive(exchange, group.state, box, ctx), inbox, foreign, exchange)
                if state is not None:
                    group.state = state
            if self.is_server:
                inbox = delivered.select(delivered.dst == SERVER_ID)
                ctx = self._server_context(phase, round_index)
                state = self._safe_receive(lambda box: method.server_receive(exchange, self.server_state, box, ctx), inbox, foreign, exchange)
                if state is not None:
                    self.server_state = state

        missing = result.absent | result.unreachable
        if missing:
            self.absent_round |= missing
            self._exchange_absent.append({"exchange": exchange, "peers": sorted(missing)})
            log.warning("%s/%d/%s: absent this round: %s", phase.name, round_index, exchange, ", ".join(sorted(missing)))
        self._node_sent += sent
        self._node_received += received_bytes
        self.clock.exchange(
            exchange, wall_s=time.perf_counter() - started, compute_s=self.clock.compute_s - computed, count=1,
            messages_sent=sum(len(f) for f in frames.values()), frame_bytes_sent=sent, raw_bytes_sent=sent_raw,
            messages_received=len(kept), frame_bytes_received=received_bytes, raw_bytes_received=received_raw,
            wire_bytes_sent=result.wire_bytes_sent,
        )
        return sent

    def _safe_receive(self, receive, inbox: Messages, foreign: bool, exchange: str):
        """The method's new state, or None to keep the old one when `receive` fails."""
        try:
            return receive(inbox)
        except Exception:  # noqa: BLE001 - what other peers send must not stop this one
            self.receive_errors += 1
            log.exception("receive of exchange %s failed on %d message(s)", exchange, len(inbox))
        if foreign:
            try:
                return receive(inbox.select(inbox.src == self.me.node))
            except Exception:  # noqa: BLE001
                log.exception("receive of exchange %s failed on this node's own messages too; state kept", exchange)
        return None


# -- the serve loop -------------------------------------------------------------------------
def _parse_start(start: dict[str, Any], peers: PeersFile) -> tuple[dict[str, Any], Limits, str]:
    if not isinstance(start.get("config"), dict) or not isinstance(start.get("peers"), dict) or not isinstance(start.get("limits"), dict):
        raise UsageError("start message lacks config, peers or limits")
    theirs = PeersFile.parse(start["peers"], "the launcher's peers")
    if sorted((p.id, p.node) for p in theirs.peers) != sorted((p.id, p.node) for p in peers.peers):
        raise UsageError("the launcher's peers (ids and clients) differ from this peer's peers file")
    return start["config"], Limits.from_dict(start["limits"]), str(start.get("run_id", ""))


def peer_config(config: "RunConfig") -> "RunConfig":
    """The config as this peer runs it: `auto` randomness resolved to `secure` (a peer is
    a separate party); seeded randomness refused unless the run is marked a simulation
    on devices (`device_simulation`), since every peer could then recompute the others'
    noise and batches from the seed. (`prepare` does the same for the device runtime;
    this holds whatever runtime the launcher's config names.)"""
    if config.noise_source == "auto":
        config = config.replace(noise_source="secure")
    if config.noise_source == "seeded" and not config.device_simulation:
        raise UsageError("seeded noise and batches on devices let every peer recompute the others' noise; "
                         "use --noise-source secure, or mark the run --device-simulation (epsilon uncertified)")
    return config


def run_session(
    transport: PeerTransport, me: PeerSpec, peers: PeersFile, start: dict[str, Any], meter: PowerMeter | None, registry=None
) -> None:
    """One run: build the data and method from the config, wait for `go`, execute, report."""
    from p4bench.config import RunConfig
    from p4bench.plugin_manager import Registry, create_plugin_manager
    from p4bench.runner import prepare

    try:
        config_values, limits, run_id = _parse_start(start, peers)
        transport.limits = limits
        transport.begin_run(run_id)
        config = peer_config(RunConfig(**config_values))
        # stray global-RNG uses (there should be none) must not be predictable from the seed either
        torch.manual_seed(config.seed if config.noise_source == "seeded" else secrets.randbits(63))
        prepared = prepare(config, registry or Registry(create_plugin_manager()))
        if prepared.job.data.num_clients != peers.num_clients:
            raise UsageError(f"the run has {prepared.job.data.num_clients} clients, the peers file {peers.num_clients}")
        node = DeviceNode(me, peers, transport, meter)
        node.setup(prepared.job, prepared.ledger)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which stops the run
        log.exception("cannot start the run")
        transport.report({"type": "error", "node": me.node, "message": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    log.info("run %s: node %d ready", run_id, me.node)
    transport.report({"type": "ready", "node": me.node})
    while True:
        try:
            message = transport.control.get(timeout=limits.startup_timeout_s)
        except queue.Empty:
            log.error("no go from the launcher within %.0f s", limits.startup_timeout_s)
            return
        if message.get("type") == "go":
            break
        if message.get("type") in ("stop", "launcher-closed"):
            return
    try:
        node.run()
    except Aborted:
        log.warning("run %s stopped by the launcher", run_id)
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("run failed")
        transport.report({"type": "error", "node": me.node, "message": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    log.info("run %s: node %d finished", run_id, me.node)


def serve(
    peer_id: str, listen: str, peers_path: str, tls_dir: str, power: str | None = None, power_interval: float = 1.0,
    threads: int | None = None, keep_serving: bool = False, idle_timeout: float | None = None,
) -> None:
    """Listen for the launcher and the other peers; run one run (or, with
    `keep_serving`, one run after another) and exit when the launcher says stop, or
    after `idle_timeout` seconds without a run to start."""
    peers = PeersFile.load(peers_path)
    me = peers.get(peer_id, peers_path)
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen expects HOST:PORT, got {listen!r}")
    if threads:
        torch.set_num_threads(int(threads))
    meter = PowerMeter(power, power_interval) if power else None
    transport = PeerTransport(me, peers, tls_dir, Limits())
    try:
        bound = transport.start(host.strip("[]") or "0.0.0.0", int(port))
        print(f"p4bench device peer {peer_id} (node {me.node}) listening on {host}:{bound}", flush=True)
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
                run_session(transport, me, peers, message, meter, registry)
                if not keep_serving:
                    _wait_for_stop(transport)
                    return
            elif kind == "stop":
                return
    finally:
        if meter is not None:
            meter.stop()
        transport.close()


def _warm_up():
    """While waiting for the launcher: load every plugin and torch's lazily imported
    gradient machinery, so the run does not wait for them (no effect on results).
    Returns the plugin registry runs are prepared with."""
    from torch.func import grad, vmap

    from p4bench.plugin_manager import Registry, create_plugin_manager

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
