"""The device runtime's network: one exchange of the round driver over TLS peers.

A device peer hands the engine's `RoundDriver` this network instead of the simulator's
in-process one; everything else a round does (local updates, attacks, defenses, the
DP mechanism, the communication ledger) is the driver's. Here: messages to this peer's
own node stay local (a node does not send to itself over the network), the others go
out as safetensors frames over the transport, and what comes back is checked (exchange
markers, payload layout) before the driver delivers it. Each round's timings (compute
versus communication, per exchange) are measured for the launcher's report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine.equivocation import messages_per_pair
from p4bench.engine.messages import Messages, PayloadLayout, encode, message_layout_of
from p4bench.engine.method import Method
from p4bench.engine.network import Delivery, Network
from p4bench.rng import SERVER_ID
from p4bench_device.measure import PowerMeter, RoundClock
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.signing_keys import PeerKeys
from p4bench_device.transport import ExchangeResult, PeerTransport

if TYPE_CHECKING:
    from p4bench.engine.runtime import Job

log = logging.getLogger("p4bench.device")

__all__ = ["TLSNetwork", "check_senders", "layout_schema", "payload_schema"]


Schema = tuple[tuple[str, str, tuple[int, ...]], ...]


def layout_schema(layout: PayloadLayout) -> Schema:
    """A payload layout as a comparable value: sorted (key, dtype, per-message shape)."""
    return tuple(sorted((k, str(dtype), tuple(shape)) for k, (dtype, shape) in layout.items()))


def payload_schema(message: Messages) -> Schema:
    """The schema of a batch's payload (key, dtype, per-message shape)."""
    return layout_schema(message_layout_of(message))


def check_senders(
    reference: Schema | None, received: list[tuple[str, Messages]]
) -> tuple[list[Messages], dict[str, str]]:
    """(kept, rejected): received (sender, message) pairs checked per sender, never by vote.

    With a `reference` (the method's declared layout, or this node's own messages in the
    exchange), a sender whose messages all have it is kept; one with any other layout
    has all its messages of the exchange dropped (`rejected[sender]` says why), since a
    peer sending malformed messages is not trusted with the rest either. Without one,
    each sender is held to its own consistency only."""
    by_sender: dict[str, list[Messages]] = {}
    for sender, message in received:
        by_sender.setdefault(sender, []).append(message)
    kept: list[Messages] = []
    rejected: dict[str, str] = {}
    for sender, messages in by_sender.items():
        schemas = {payload_schema(m) for m in messages}
        wrong = (
            schemas - {reference}
            if reference is not None
            else (schemas if len(schemas) > 1 else set())
        )
        if wrong:
            rejected[sender] = f"{len(messages)} message(s), layouts {sorted(wrong)[:2]}"
        else:
            kept += messages
    return kept, rejected


class TLSNetwork(Network):
    """Exchanges of one peer (holding one client, or the server) with the other peers."""

    untrusted = True  # other peers' messages must never stop this one

    def __init__(
        self,
        me: PeerSpec,
        peers: PeersFile,
        transport: PeerTransport,
        meter: PowerMeter | None = None,
    ) -> None:
        self.me, self.transport, self.meter = me, transport, meter
        key = getattr(transport, "signing_key", None)
        # the equivocation check's signatures: this peer's own TLS key, never a shared one
        self.node_keys = PeerKeys(me, peers, key) if key is not None else None
        self.peer_of = {p.node: p.id for p in peers.peers}
        self.others = {p.id for p in peers.peers if p.id != me.id}
        self.steps_done_at = time.perf_counter()
        self.seq = 0  # every node advances it identically: it delimits exchanges on the wire
        self.clock = RoundClock()
        self.figures: dict[str, Any] = {}  # the last round's timings, for the launcher's report
        self.absent_round: set[str] = set()
        self.absences: list[dict[str, Any]] = []  # this round's absent peers, per exchange
        self.slow_dropped: list[
            dict[str, Any]
        ] = []  # peers this one dropped as slow in this round (`liveness`)
        self._exchange_started = (0.0, 0.0)
        self.method: Method | None = (
            None  # the run's (set by the node): its declared payload layouts
        )
        self._warned: set[tuple[str, str]] = set()
        self._exchange_figures: dict[str, Any] = {}
        # (phase, exchange timeout) -> seconds this peer holds its batches back: a malicious
        # client under an attack that times its sends (`late-sender`'s `send_delay_s`)
        self.send_delay: Callable[[str, float], float] | None = None

    def attach(self, job: Job) -> None:
        """The run's job (set by the node): its method (declared payload layouts, messages
        per pair) and, when this peer's client is malicious under an attack with a
        ``send_delay_s(exchange_timeout_s)``, when its batches leave."""
        self.method, attack, malicious = job.method, job.attack, job.malicious
        timed = getattr(attack, "send_delay_s", None)
        node = self.me.node
        self.send_delay = None
        if (
            callable(timed)
            and malicious is not None
            and 0 <= node < len(malicious)
            and bool(malicious[node])
        ):
            assert attack is not None
            acts_in = attack.acts_in
            self.send_delay = lambda phase, timeout: (
                float(timed(timeout)) if acts_in(phase) else 0.0
            )
            log.warning(
                "this peer's client is malicious under %s: it holds its batches back", attack.name
            )

    # -- round bookkeeping ------------------------------------------------------------
    def begin_round(self, phase: str, round_index: int) -> None:
        self.transport.new_round()
        self.absent_round, self.absences, self.slow_dropped = set(), [], []
        self._before = self.transport.snapshot()
        # the previous round's evaluation and report: local work a partner may wait for
        self.clock = RoundClock(between_rounds_s=time.perf_counter() - self.steps_done_at)

    def steps_finished(self, phase: str, round_index: int) -> None:
        self.steps_done_at = time.perf_counter()
        self.figures = self.clock.finish(self.meter)
        after = self.transport.snapshot()
        for key in ("wire_bytes_sent", "wire_bytes_received"):
            self.figures[key] = int(after.get(key, 0) - self._before.get(key, 0))

    def computing(self) -> AbstractContextManager[None]:
        return self.clock.compute()

    def start_exchange(self, exchange: str) -> None:
        self.clock.barrier()
        self._exchange_started = (time.perf_counter(), self.clock.compute_s)

    def finish_exchange(self, exchange: str) -> None:
        started, computed = self._exchange_started
        self.clock.exchange(
            exchange,
            wall_s=time.perf_counter() - started,
            compute_s=self.clock.compute_s - computed,
            count=1,
            **self._exchange_figures,
        )

    def receive_failed(self, exchange: str, messages: int) -> None:
        log.exception("receive of exchange %s failed on %d message(s)", exchange, messages)

    # -- one exchange -------------------------------------------------------------------
    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        self.seq += 1
        own, frames, sent_sizes, sent_raw = self._frames(exchange, round_index, outgoing)
        marker = {"exchange": exchange, "round": round_index, "phase": phase}
        delay = (
            self.send_delay(phase, self.transport.limits.exchange_timeout_s)
            if self.send_delay
            else 0.0
        )
        result = self.transport.exchange(
            self.seq,
            frames,
            marker,
            self.others - self.absent_round,
            set(self.others),
            self._per_pair(exchange, phase, round_index),
            delay,
        )
        received = self._received(result, exchange, phase, round_index)
        self.slow_dropped += result.dropped  # announced in this round's report
        kept, rejected = check_senders(
            self._reference(exchange, phase, round_index, outgoing),
            [(p, m) for p, m, _ in received],
        )
        for peer, detail in sorted(rejected.items()):
            self.transport.rejects.reject(
                f"payload layout from {peer}", peer, f"{detail} in {phase}/{round_index}/{exchange}"
            )
        kept_ids = {id(m) for m in kept}
        kept_sizes = [nbytes for _, m, nbytes in received if id(m) in kept_ids]
        missing = result.absent | result.unreachable
        if missing:
            self.absent_round |= missing
            self.absences.append({"exchange": exchange, "peers": sorted(missing)})
            log.warning(
                "%s/%d/%s: absent this round: %s",
                phase,
                round_index,
                exchange,
                ", ".join(sorted(missing)),
            )
        self._exchange_figures = {
            "messages_sent": sum(len(f) for f in frames.values()),
            "frame_bytes_sent": int(sent_sizes.sum()),
            "raw_bytes_sent": sent_raw,
            "messages_received": len(kept),
            "frame_bytes_received": sum(kept_sizes),
            "raw_bytes_received": sum(int(m.payload_nbytes()[0]) for m in kept),
            "wire_bytes_sent": result.wire_bytes_sent,
        }
        inbox_sizes = torch.tensor([0] * len(own) + kept_sizes, dtype=torch.int64)
        return Delivery(Messages.concat(own + kept), inbox_sizes, sent_sizes)

    def _per_pair(self, exchange: str, phase: str, round_index: int) -> dict[str, int] | None:
        """The most messages each other peer may send this one in the exchange (the
        method's `messages_per_pair`, `server_messages_per_pair` for the server's peer):
        the transport rejects extras before buffering them. None: no method yet."""
        if self.method is None:
            return None
        per_client, per_server = messages_per_pair(
            self.method, exchange, phase, round_index, len(self.peer_of)
        )
        return {
            peer: per_server if node == SERVER_ID else per_client
            for node, peer in self.peer_of.items()
            if peer in self.others
        }

    def _frames(
        self, exchange: str, round_index: int, outgoing: Messages
    ) -> tuple[list[Messages], dict[str, list[bytes]], torch.Tensor, int]:
        """(messages to this node, frames per peer, wire size of each outgoing message, raw payload bytes sent)."""
        own: list[Messages] = []
        frames: dict[str, list[bytes]] = {}
        sizes = torch.zeros(len(outgoing), dtype=torch.int64)
        raw = 0
        for position, message in enumerate(outgoing.split() if len(outgoing) else []):
            destination = int(message.dst[0])
            if destination == self.me.node:
                own.append(message)
                continue
            peer = self.peer_of.get(destination)
            if peer is None:
                log.error(
                    "exchange %s: message to node %d, which no peer holds; dropped",
                    exchange,
                    destination,
                )
                continue
            frame = encode(exchange, round_index, message)
            frames.setdefault(peer, []).append(frame)
            sizes[position] = len(frame)
            raw += int(message.payload_nbytes()[0])
        return own, frames, sizes, raw

    def _reference(
        self, exchange: str, phase: str, round_index: int, outgoing: Messages
    ) -> Schema | None:
        """The layout senders are held to: the method's declaration, else this node's own
        messages of the exchange (every honest node runs the same method), else none."""
        declared = (
            self.method.message_layout(exchange, phase, round_index)
            if self.method is not None
            else None
        )
        own = payload_schema(outgoing) if len(outgoing) else None
        if declared is not None:
            schema = layout_schema(declared)
            if (
                own is not None and own != schema
            ):  # a wrong declaration must not cut off honest peers
                if (phase, exchange) not in self._warned:
                    self._warned.add((phase, exchange))
                    log.error(
                        "exchange %s: the method declares layout %s but sends %s; holding peers to what it sends",
                        exchange,
                        schema,
                        own,
                    )
                return own
            return schema
        if own is None and (phase, exchange) not in self._warned:
            self._warned.add((phase, exchange))
            log.warning(
                "exchange %s: the method declares no payload layout and this node sends none: peers' messages "
                "are checked for consistency per sender only (declare Method.message_layout)",
                exchange,
            )
        return own

    def _received(
        self, result: ExchangeResult, exchange: str, phase: str, round_index: int
    ) -> list[tuple[str, Messages, int]]:
        """(sender, message, frame size) of peers whose batch belongs to this exchange."""
        received: list[tuple[str, Messages, int]] = []
        for peer in sorted(result.received):
            their_marker, items = result.received[peer]
            if (their_marker["exchange"], their_marker["round"], their_marker["phase"]) != (
                exchange,
                round_index,
                phase,
            ):
                self.transport.rejects.reject(
                    "out of step",
                    peer,
                    f"marker {their_marker} during {phase}/{round_index}/{exchange}",
                )
                result.absent.add(peer)
                continue
            if their_marker["count"] != len(items):
                log.warning(
                    "exchange %s: %d of %d messages from %s were valid",
                    exchange,
                    len(items),
                    their_marker["count"],
                    peer,
                )
            for got_exchange, got_round, message, nbytes in items:
                if (got_exchange, got_round) != (exchange, round_index):
                    self.transport.rejects.reject(
                        "out of step", peer, f"message for {got_exchange}/{got_round}"
                    )
                    continue
                received.append((peer, message, nbytes))
        return received
