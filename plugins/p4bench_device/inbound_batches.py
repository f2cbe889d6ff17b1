"""What a peer's `Inbound` (`p4bench_device.inbound`) holds of what the other peers sent:
the batches of each exchange, per sender (`Batch`: its messages, end marker, sizes and
timing), a data frame accepted into its batch (the run's epoch, the exchange window,
the sender's own node as source, this node as destination, at most the exchange's
per-pair message count, checked before a message is decoded or buffered), the buffer
caps, and which senders an exchange still waits for, up to their deadlines
(`await_markers`, `gone`, `arrivals`; the deadlines are `liveness`'s)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p4bench.engine.messages import MessageFormatError, Messages, decode
from p4bench_device.admission import FrameConnection, Gate, RejectLog
from p4bench_device.liveness import Arrival, exchange_deadline_s, majority_median
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import HEADER_BYTES, KIND_MESSAGE, Limits, RejectedFrame, load_json

log = logging.getLogger("p4bench.device")

__all__ = ["Batch", "EPOCH_SHIFT", "InboundBatches", "MARKER_FIELDS", "Received"]

MARKER_FIELDS = {"exchange": str, "round": int, "phase": str, "count": int}
EPOCH_SHIFT = 40  # wire seq = run epoch (24 bits) << 40 | exchange number

Received = tuple[str, int, Messages, int]  # exchange, round, message, frame bytes


@dataclass
class Batch:
    """What one sender sent for one exchange, on one connection."""

    connection: int
    messages: list[Received] = field(default_factory=list)
    marker: dict[str, Any] | None = None
    nbytes: int = 0
    started: float = 0.0  # loop time its first frame's header was read
    done_at: float = 0.0  # ... its end marker was accepted
    wire: int = 0  # frame headers and bodies
    extra: int = 0  # messages rejected beyond the exchange's per-pair limit (unread, unbuffered)


class InboundBatches:
    """The batches buffered per exchange and sender (the base of `Inbound`, whose `me`,
    `peers`, `limits`, connection `gate` and `stats` it reads)."""

    me: PeerSpec
    peers: PeersFile
    _limits: Callable[[], Limits]
    gate: Gate
    rejects: RejectLog
    stats: Counter[str]

    def __init__(self) -> None:
        self.batches: dict[int, dict[str, Batch]] = {}
        self.buffered: Counter[str] = Counter()  # message bytes buffered per sender
        self.reading: Counter[str] = Counter()  # message bytes being read per sender (reserved)
        self.cut: set[str] = (
            set()
        )  # peers whose last connection this side ended (idle, too slow, ...): not gone
        self.misbehaved: dict[
            str, str
        ] = {}  # ... ended for misbehaving (why), not reconnected since: not waited for
        self.seen: set[str] = set()
        self.model_bytes = 0
        self.current_seq = 0
        self.closed_seq = 0
        self.epoch = 0  # high bits of every wire seq: frames of another run never mix in
        self.started = 0.0  # loop time the current exchange started here (deadlines count from it)
        self.per_pair: dict[
            str, int
        ] = {}  # the current exchange's message limit per sender (none: unchecked)
        self.arrival = asyncio.Event()  # a batch completed, or a sender left: exchanges look again

    def drop_buffers(self) -> None:
        self.batches.clear()
        self.buffered.clear()

    def buffer_caps(self) -> tuple[int, int]:
        """(per-sender, total) bytes of messages this peer buffers now."""
        return self._limits().buffer_caps(self.model_bytes, len(self.peers.peers) - 1)

    def take(self, seq: int) -> dict[str, Batch]:
        """The batches of exchange `seq`, no longer buffered."""
        batches = self.batches.pop(seq, {})
        for source, batch in batches.items():
            self.buffered[source] -= batch.nbytes
        return batches

    def start_exchange(self, seq: int, per_pair: dict[str, int] | None) -> None:
        """Exchange `seq` starts here now: deadlines count from now, and each sender's
        messages beyond `per_pair[sender]` (frames that came ahead of it included) are
        rejected as extra (None: no limits known)."""
        self.current_seq, self.per_pair = seq, dict(per_pair or {})
        self.started = asyncio.get_running_loop().time()
        self.drop_before(seq)
        for source, batch in self.batches.get(seq, {}).items():
            limit = self.per_pair.get(source)
            if limit is not None and len(batch.messages) > limit:
                for _, _, _, nbytes in batch.messages[limit:]:
                    batch.nbytes -= nbytes
                    self.buffered[source] -= nbytes
                    self._extra(batch, source, seq, limit)
                del batch.messages[limit:]

    def _extra(self, batch: Batch, source: str, seq: int, limit: int) -> None:
        batch.extra += 1
        self.rejects.reject(
            f"extra message from {source}", source, f"more than {limit} in exchange {seq}"
        )

    def drop_before(self, seq: int) -> None:
        """Forget the batches of exchanges before `seq` (late frames of closed exchanges)."""
        for old in [s for s in self.batches if s < seq]:
            self.take(old)

    def buffer_full(self, source: str, nbytes: int) -> RejectedFrame | None:
        """Why `nbytes` more from `source` do not fit (bodies being read count as buffered)."""
        per_sender, total = self.buffer_caps()
        mine = self.buffered[source] + self.reading[source]
        if mine + nbytes > per_sender:
            return RejectedFrame(
                "buffer full", f"{mine} bytes from {source} not consumed yet (cap {per_sender})"
            )
        everyone = sum(self.buffered.values()) + sum(self.reading.values())
        if everyone + nbytes > total:
            return RejectedFrame(
                "buffer full", f"{everyone} bytes from all senders not consumed yet (cap {total})"
            )
        return None

    def gone(self, peer: str) -> bool:
        """A peer the launcher dropped, or one that connected in this run and closed every
        connection (not one whose last connection this side ended: it reconnects to send)."""
        if (
            peer in self.gate.refused or peer in self.misbehaved
        ):  # dropped, or cut for misbehaving (`liveness`)
            return True
        return peer in self.seen and not self.gate.inbound.get(peer) and peer not in self.cut

    def _judged(self, expected: set[str], batches: dict[str, Batch]) -> dict[str, float | None]:
        """The expected senders judged this exchange -> when their batch completed, in seconds
        from the exchange's start here (None: not complete). Not judged: a sender that was
        dropped, or that left (closed every connection, not cut by this side)."""
        judged: dict[str, float | None] = {}
        for peer in expected - self.gate.refused:
            batch = batches.get(peer)
            if batch is not None and batch.marker is not None:
                judged[peer] = max(batch.done_at - self.started, 0.0)  # early frames: on time
            elif peer in self.misbehaved or not self.gone(peer):
                judged[peer] = None
        return judged

    def arrivals(self, expected: set[str], batches: dict[str, Batch]) -> dict[str, Arrival]:
        """How each judged sender's batch arrived, with its deadline, for the drop policy."""
        judged, limits = self._judged(expected, batches), self._limits()
        median = majority_median(judged.values())
        arrivals: dict[str, Arrival] = {}
        for peer, finished in judged.items():
            batch = batches.get(peer) or Batch(-1)
            deadline = exchange_deadline_s(batch.wire, median, limits)
            if finished is not None:
                seconds = batch.done_at - batch.started
                arrivals[peer] = Arrival(
                    True, batch.wire, seconds, None, finished, deadline, batch.extra
                )
            else:
                arrivals[peer] = Arrival(
                    False, batch.wire, 0.0, self.misbehaved.get(peer), None, deadline, batch.extra
                )
        return arrivals

    def deadline_at(
        self, expected: set[str], batches: dict[str, Batch], waiting: list[str]
    ) -> float | None:
        """Loop time at which every `waiting` sender is past its deadline (None: no majority
        complete yet, so no deadline: wait up to the exchange timeout)."""
        judged, limits = self._judged(expected, batches), self._limits()
        median = majority_median(judged.values())
        if median is None:
            return None
        latest = 0.0
        for peer in waiting:
            batch = batches.get(peer)
            deadline = exchange_deadline_s(batch.wire if batch else 0, median, limits)
            latest = max(latest, deadline or 0.0)
        return self.started + latest

    async def await_markers(self, seq: int, expected: set[str], deadline: float) -> None:
        """Wait until every expected sender's batch of `seq` is complete or the sender is gone,
        or until the waiting senders' deadlines (`liveness`), or `deadline` (loop time: the
        exchange timeout) at the latest. Bytes arriving move a sender's deadline: looked at again then."""
        loop = asyncio.get_running_loop()
        while True:
            self.arrival.clear()
            batches = self.batches.get(seq, {})
            waiting = [
                s
                for s in expected
                if not (s in batches and batches[s].marker is not None) and not self.gone(s)
            ]
            late_at = self.deadline_at(expected, batches, waiting) if waiting else None
            stop = deadline if late_at is None else min(deadline, late_at)
            remaining = stop - loop.time()
            if not waiting or remaining <= 0:
                if waiting:
                    log.warning(
                        "exchange %d: no end marker from %s %s",
                        seq,
                        ", ".join(sorted(waiting)),
                        f"within {self._limits().exchange_timeout_s:.1f} s"
                        if stop == deadline
                        else f"by their deadline, {late_at - self.started:.1f} s from the exchange's start"
                        if late_at is not None
                        else "",
                    )
                return
            try:
                await asyncio.wait_for(self.arrival.wait(), min(remaining, 1.0))
            except TimeoutError:
                pass

    def _batch(self, connection: FrameConnection, seq: int) -> Batch:
        """The sender's batch of `seq` on this connection (a new one when it reconnected:
        it resends the whole batch; its extra messages still count)."""
        source, batches = connection.name, self.batches.setdefault(seq, {})
        batch = batches.get(source)
        if batch is None or batch.connection != connection.id:
            extra = 0
            if batch is not None:
                self.buffered[source] -= batch.nbytes
                extra = batch.extra
            batch = batches[source] = Batch(connection.id, started=connection.frame_at, extra=extra)
        return batch

    def _accept_data(
        self, connection: FrameConnection, node: int, kind: int, seq: int, body: bytes
    ) -> None:
        source, limits = connection.name, self._limits()
        self.seen.add(source)
        if seq >> EPOCH_SHIFT != self.epoch >> EPOCH_SHIFT:
            raise RejectedFrame(
                "another run",
                f"exchange epoch {seq >> EPOCH_SHIFT}, this run's is {self.epoch >> EPOCH_SHIFT}",
            )
        seq &= (1 << EPOCH_SHIFT) - 1
        if seq <= self.closed_seq:
            self.stats["stale_frames"] += (
                1  # a late sender's frame for an exchange already closed here
            )
            return
        if seq > self.current_seq + limits.max_ahead:
            raise RejectedFrame(
                "too far ahead", f"exchange {seq}, this peer is at {self.current_seq}"
            )
        marker: dict[str, Any] | None = None
        batch = self._batch(connection, seq)
        if batch.marker is not None:
            raise RejectedFrame("frame after its end marker")
        if kind == KIND_MESSAGE:
            limit = self.per_pair.get(source) if seq == self.current_seq else None
            if (
                limit is not None and len(batch.messages) >= limit
            ):  # counted before it is decoded or buffered
                batch.extra += 1
                raise RejectedFrame(
                    f"extra message from {source}", f"more than {limit} in exchange {seq}"
                )
            try:
                exchange, round_index, message = decode(body, limits.max_message_bytes)
            except MessageFormatError as exc:
                raise RejectedFrame("malformed message", str(exc)) from None
            if int(message.src[0]) != node:
                raise RejectedFrame(
                    "spoofed source",
                    f"node {int(message.src[0])} on the connection of {source} (node {node})",
                )
            if int(message.dst[0]) != self.me.node:
                raise RejectedFrame(
                    "wrong destination", f"node {int(message.dst[0])}, this is node {self.me.node}"
                )
            if len(exchange) > 200:
                raise RejectedFrame("malformed message", "exchange name too long")
        else:
            marker = load_json(body, MARKER_FIELDS)
            if (
                not 0 <= marker["count"] <= 10_000_000
                or len(marker["exchange"]) > 200
                or len(marker["phase"]) > 200
            ):
                raise RejectedFrame("malformed marker", "count or names out of range")
        batch.wire += HEADER_BYTES + len(body)
        if marker is None:
            full = self.buffer_full(source, len(body))
            if full is not None:
                raise full
            batch.messages.append((exchange, round_index, message, len(body)))
            batch.nbytes += len(body)
            self.buffered[source] += len(body)
        else:
            batch.marker = marker
            batch.done_at = asyncio.get_running_loop().time()
            self.arrival.set()
