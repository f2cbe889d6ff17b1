"""TLS transport of the device runtime, on an asyncio loop in a background thread.

A peer listens on one port. Other peers connect to it to send method messages and
end-of-exchange markers; the launcher connects to it to send control messages and
reads its reports back on the same connection. Every connection is mutually
authenticated with the run's CA and the certificate's common name is the sender's
identity: a message whose source is not that identity is rejected.

The driver (the method's schedule) runs in the main thread and calls the synchronous
methods here; the loop thread keeps reading every connection meanwhile, so senders
never wait for a receiver that is busy computing.

Exchange `seq` (a counter every node advances identically) delimits exchanges: for
each one a sender writes its messages to every destination, then an end marker with
the number of messages to every peer. A receiver has a sender's complete batch when
its marker arrives; a sender whose connection closed (and has not reconnected) or
whose marker does not arrive before the exchange timeout is absent from the exchange.
A sender slow in several consecutive exchanges is dropped by this peer (`liveness`).

Hardening (see `Limits`): connections are accepted raw (`listener`) and, until
authenticated, get a small handshake budget that evicts its oldest silent or stalled
entry when full, never a completed handshake (`admission`); authenticated ones are capped
in total and per identity, closed when idle (the launcher pings) or when a frame body
trickles in (a sender cut so is not waited for until it reconnects); data is only
buffered during a run (`begin_run` .. `end_run`), within caps that scale with the run's
model size (`set_model_bytes`); a peer the launcher dropped is refused (`refuse`). The
launcher's side of the connections is `launcher_link.LauncherLink` (re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p4bench.engine.messages import MessageFormatError, Messages, decode
from p4bench.plugins.device.admission import (
    NETWORK_ERRORS,
    FrameConnection,
    Gate,
    LoopThread,
    RejectLog,
    close_on_loop,
    open_frames,
)
from p4bench.plugins.device.launcher_link import EVENT_RECONNECTED, LauncherLink, parse_report
from p4bench.plugins.device.listener import Listener
from p4bench.plugins.device.liveness import SLOW_DROP_REASON, Arrival, SlowPeers
from p4bench.plugins.device.peers import PeersFile, PeerSpec
from p4bench.plugins.device.protocol import (
    HEADER_BYTES,
    KIND_CONTROL,
    KIND_END,
    KIND_MESSAGE,
    KIND_REPORT,
    KIND_STATE,
    MAX_IDLE_BODY_BYTES,
    MAX_JSON_BYTES,
    FrameError,
    Limits,
    RejectedFrame,
    dump_json,
    header_problem,
    load_json,
    read_header,
    skip_body,
)
from p4bench.plugins.device.tls import LAUNCHER, client_context, server_context

log = logging.getLogger("p4bench.device")

MARKER_FIELDS = {"exchange": str, "round": int, "phase": str, "count": int}
EPOCH_SHIFT = 40  # wire seq = run epoch (24 bits) << 40 | exchange number

__all__ = ["PeerTransport", "LauncherLink", "FrameConnection", "ExchangeResult", "RejectLog", "LoopThread", "open_frames",
           "parse_report", "EVENT_RECONNECTED"]


@dataclass
class _Batch:
    """What one sender sent for one exchange, on one connection."""

    connection: int
    messages: list[tuple[str, int, Messages, int]] = field(default_factory=list)  # exchange, round, message, frame bytes
    marker: dict[str, Any] | None = None
    nbytes: int = 0
    started: float = 0.0  # loop time its first frame's header was read
    done_at: float = 0.0  # ... its end marker was accepted
    wire: int = 0  # frame headers and bodies


@dataclass
class ExchangeResult:
    received: dict[str, tuple[dict[str, Any], list[tuple[str, int, Messages, int]]]]  # sender -> (marker, messages)
    absent: set[str]  # expected senders whose batch did not complete
    unreachable: set[str]  # destinations that could not be sent to
    wire_bytes_sent: int = 0
    dropped: list[dict[str, Any]] = field(default_factory=list)  # senders dropped as slow at this exchange (`liveness`)


class PeerTransport:
    """The network side of one peer (see the module docstring).

    Per run, the node calls `begin_run` (before any peer can send), `set_model_bytes` once
    the run's model is built, and `end_run` when the run is over; `shaper` (an object with
    ``async pace(nbytes)``, or None) shapes what this peer sends to peers and the launcher."""

    def __init__(self, me: PeerSpec, peers: PeersFile, tls_dir: str | Path, limits: Limits) -> None:
        self.me, self.peers, self.limits = me, peers, limits
        self.server_context = server_context(tls_dir, me.id)
        self.client_context = client_context(tls_dir, me.id)
        self.rejects = RejectLog()
        self.control: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stats: Counter[str] = Counter()
        self.shaper: Any = None  # a `Shaper` (link.LinkShaper: the node also reads its figures), or None
        # owned by the loop thread:
        self._batches: dict[int, dict[str, _Batch]] = {}
        self._buffered: Counter[str] = Counter()  # message bytes buffered per sender
        self._reading: Counter[str] = Counter()  # message bytes being read per sender (reserved)
        self._cut: set[str] = set()  # peers whose last connection this side ended (idle, too slow, ...): not gone
        self._misbehaved: dict[str, str] = {}  # ... ended for misbehaving (why), not reconnected since: not waited for
        self._slow = SlowPeers()  # the drop policy for slow senders (`liveness`)
        self._seen: set[str] = set()
        self._out: dict[str, FrameConnection] = {}
        self._unreachable: set[str] = set()
        self._launcher: FrameConnection | None = None
        self._gate = Gate(self.server_context, lambda: self.limits, self.rejects,
                          lambda name: name == LAUNCHER or (name in self.peers.by_id and name != me.id), len(peers.peers))
        self._run_active = False
        self._model_bytes = 0
        self._before_run: dict[str, int] = {}  # rejections between the last run and this one
        self._counts_at_end: dict[str, int] = {}
        self.current_seq = 0
        self._closed_seq = 0
        self._epoch = 0  # high bits of every wire seq: frames of another run never mix in
        self._server: Listener | None = None
        self._thread = LoopThread(f"p4bench-device-{me.id}")
        self._arrival = self._thread.call(self._make_event())

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        return self._thread.call(self._start(host, port), timeout=30)

    async def _start(self, host: str, port: int) -> int:
        self._server = Listener(host, port, self._accept)
        return self._server.port

    def close(self) -> None:
        def close_all() -> None:
            if self._server is not None:
                self._server.close()
            for connection in [*self._out.values(), *([self._launcher] if self._launcher else [])]:
                connection.close()

        close_on_loop(self._thread, close_all)

    def begin_run(self, run_id: str = "") -> None:
        """A new run starts: forget every buffered frame, connection history, refusal,
        rejection count and statistic of the last one, and accept data frames again.
        Exchange numbers on the wire carry the run's epoch (from its id) in their top 24 bits."""

        async def reset() -> None:
            self._drop_buffers()
            self._seen.clear()
            self._unreachable.clear()
            self._cut.clear()
            self._misbehaved.clear()
            self._slow.reset()
            self._gate.refused.clear()
            self._gate.refused_why.clear()
            self.stats.clear()
            counts = Counter(self.rejects.reset())
            counts.subtract(self._counts_at_end)  # the last run's own counts were in its final report
            self._before_run, self._counts_at_end = {k: v for k, v in counts.items() if v > 0}, {}
            if self._before_run:
                log.warning("rejected between runs: %s", self._before_run)
            self._model_bytes = 0
            self.current_seq = self._closed_seq = 0
            self._epoch = (zlib.crc32(run_id.encode()) & 0xFFFFFF) << EPOCH_SHIFT
            self._run_active = True

        self._thread.call(reset(), timeout=10)

    def end_run(self) -> None:
        """The run is over: drop every buffered batch; until the next `begin_run`, data
        frames are refused unread beyond a few KiB ("no run active")."""

        async def end() -> None:
            self._run_active = False
            self._drop_buffers()
            self._counts_at_end = self.rejects.snapshot()

        self._thread.call(end(), timeout=10)

    def set_model_bytes(self, nbytes: int) -> None:
        """The run's model size in bytes: the buffering caps scale with it (`Limits.buffer_caps`)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"model bytes must be an integer >= 0, got {nbytes!r}")

        async def store() -> None:
            self._model_bytes = nbytes

        self._thread.call(store(), timeout=10)

    def buffer_caps(self) -> tuple[int, int]:
        """(per-sender, total) bytes of messages this peer buffers now."""
        return self.limits.buffer_caps(self._model_bytes, len(self.peers.peers) - 1)

    def refuse(self, peer_id: str) -> None:
        """Refuse `peer_id` for the rest of this run (the launcher dropped it): its
        connections are closed, new ones refused, its buffered frames dropped, and
        exchanges no longer wait for it or send to it. ValueError for an unknown peer."""
        self._thread.call(self._refuse(peer_id), timeout=10)

    async def _refuse(self, peer: str, why: str = "dropped by the launcher") -> None:
        if peer not in self.peers.by_id or peer == self.me.id:
            raise RejectedFrame("malformed control", f"drop of unknown peer {peer[:60]!r}")
        if not self._gate.refuse(peer, why):
            return
        log.warning("peer %s %s: refused for the rest of this run", peer, why)
        outbound = self._out.pop(peer, None)
        if outbound is not None:
            outbound.abort()
        for batches in self._batches.values():
            batch = batches.pop(peer, None)
            if batch is not None:
                self._buffered[peer] -= batch.nbytes
        self._arrival.set()

    def _drop_buffers(self) -> None:
        self._batches.clear()
        self._buffered.clear()

    def new_round(self) -> None:
        """Destinations that failed in the last round get another chance (rejoin)."""

        async def reset() -> None:
            self._unreachable.clear()

        self._thread.call(reset(), timeout=10)

    def snapshot(self) -> dict[str, Any]:
        """This run's statistics, rejection counts and refused peers (and the rejections
        between the last run and this one, when there were any)."""

        async def read() -> dict[str, Any]:
            extra = {"rejected_before_run": dict(self._before_run)} if self._before_run else {}
            return {**self.stats, "rejected": self.rejects.snapshot(), "refused": sorted(self._gate.refused),
                    "slow_dropped": [dict(entry) for entry in self._slow.dropped], **extra}

        return self._thread.call(read(), timeout=10)

    # -- accepting connections --------------------------------------------------------
    async def _accept(self, sock: socket.socket, address: Any) -> None:
        connection: FrameConnection | None = None
        try:
            connection = await self._gate.enter(sock, address)
            if connection is None:
                return
            if connection.name == LAUNCHER:
                await self._serve_launcher(connection)
            else:
                await self._serve_peer(connection)
        except asyncio.CancelledError:
            return  # evicted, or shutting down: end the connection's task quietly
        except Exception as exc:  # noqa: BLE001 - nothing a remote sends may end the peer
            log.exception("connection from %s failed: %s", address, exc)
        finally:
            if connection is not None:
                self._gate.leave(connection)
                connection.abort()  # the other end left or misbehaved: no TLS goodbye (it could hold the socket 30 s)

    def _body_limit(self, launcher: bool) -> tuple[int, str]:
        """(largest frame body read now on a connection, why)."""
        if launcher:
            return MAX_JSON_BYTES, "control messages are JSON"
        if not self._run_active:
            return MAX_IDLE_BODY_BYTES, "no run active"
        per_sender = self.buffer_caps()[0]
        return min(self.limits.max_message_bytes, per_sender), f"per-sender buffer cap {per_sender}"

    def _refusal(self, source: str, kind: int, length: int) -> RejectedFrame | None:
        """Why a peer's frame is rejected before its body is read (None: read it)."""
        if kind not in (KIND_MESSAGE, KIND_END):
            return RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from a peer")
        if not self._run_active:
            return RejectedFrame("no run active", f"{length}-byte {chr(kind)!r} frame")
        if source in self._gate.refused:
            return RejectedFrame(self._gate.refused_why.get(source, "dropped by the launcher"), "frame refused")
        if kind == KIND_END and length > MAX_JSON_BYTES:
            return RejectedFrame("oversized JSON", f"{length} bytes > {MAX_JSON_BYTES}")
        if kind == KIND_MESSAGE:
            return self._buffer_full(source, length)
        return None

    def _buffer_full(self, source: str, nbytes: int) -> RejectedFrame | None:
        """Why `nbytes` more from `source` do not fit (bodies being read count as buffered)."""
        per_sender, total = self.buffer_caps()
        mine = self._buffered[source] + self._reading[source]
        if mine + nbytes > per_sender:
            return RejectedFrame("buffer full", f"{mine} bytes from {source} not consumed yet (cap {per_sender})")
        everyone = sum(self._buffered.values()) + sum(self._reading.values())
        if everyone + nbytes > total:
            return RejectedFrame("buffer full", f"{everyone} bytes from all senders not consumed yet (cap {total})")
        return None

    async def _frames(
        self, connection: FrameConnection, handle: Callable[[int, int, bytes], Any], launcher: bool = False
    ) -> str | None:
        """Read frames until the stream ends; reject bad ones (unread where possible); stop on
        broken framing, on an oversized frame, when idle or when a frame body trickles in.
        Why this side ended the connection ("idle", or the misbehaviour), None when the other end did."""
        source, reader, frames = connection.name, connection.reader, 0
        while True:
            limits = self.limits  # a run's limits replace the defaults, also on connections already open
            try:
                async with asyncio.timeout(limits.idle_timeout_s):
                    hard_cap = MAX_JSON_BYTES if launcher else limits.max_message_bytes
                    version, kind, seq, length = await read_header(reader, hard_cap)
            except TimeoutError:
                if frames:  # a sender between exchanges (it takes a fresh connection after idle_timeout_s / 2)
                    self.stats["idle_closed"] += 1
                else:  # silent since its handshake
                    self.rejects.reject("idle connection", source, f"no frame for {limits.idle_timeout_s} s; closing the connection")
                return "idle"
            except FrameError as exc:
                self.rejects.reject("broken framing", source, f"{exc}; closing the connection")
                return "broken framing"
            except (*NETWORK_ERRORS, ValueError):
                return None
            connection.frame_at = asyncio.get_running_loop().time()
            limit, why = self._body_limit(launcher)
            if length > limit:
                self.rejects.reject("oversized frame", source, f"{length} bytes > {limit} ({why}); closing the connection")
                return "oversized frame"
            problem = header_problem(version, kind) or (None if launcher else self._refusal(source, kind, length))
            reserved = length if problem is None and kind == KIND_MESSAGE else 0
            self._reading[source] += reserved  # bodies being read count against the buffer caps
            deadline = min(limits.idle_timeout_s, 10.0) + length / limits.min_rate_bytes_s
            try:
                async with asyncio.timeout(deadline):
                    body = await (skip_body(reader, length) if problem else reader.readexactly(length))
            except TimeoutError:
                self.rejects.reject("slow frame", source, f"{length}-byte body not in within {deadline:.1f} s; closing")
                return "slow frame"
            except (*NETWORK_ERRORS, ValueError):
                return None
            finally:
                self._reading[source] -= reserved
            frames += 1
            if problem is not None:
                self.rejects.reject(problem.reason, source, problem.detail)
                continue
            self.stats["wire_bytes_received"] += HEADER_BYTES + length
            self.stats["frames_received"] += 1
            try:
                result = handle(kind, seq, body)
                if asyncio.iscoroutine(result):
                    await result
            except RejectedFrame as exc:
                self.rejects.reject(exc.reason, source, exc.detail)

    async def _serve_peer(self, connection: FrameConnection) -> None:
        name = connection.name
        node = self.peers.by_id[name].node
        self._seen.add(name)
        self._misbehaved.pop(name, None)  # a new connection: waited for again
        cut: str | None = None
        try:
            cut = await self._frames(connection, lambda kind, seq, body: self._accept_data(connection, node, kind, seq, body))
        finally:
            if cut:  # it may well reconnect to send (an idle connection, say): not taken for gone
                self._cut.add(name)
            else:
                self._cut.discard(name)
            others = [c for c in self._gate.inbound.get(name, {}).values() if c is not connection and not c.closed]
            if cut and cut != "idle" and not others:  # cut for misbehaving: not waited for until it reconnects
                self._misbehaved[name] = cut
            self._arrival.set()

    def _accept_data(self, connection: FrameConnection, node: int, kind: int, seq: int, body: bytes) -> None:
        source = connection.name
        self._seen.add(source)
        if seq >> EPOCH_SHIFT != self._epoch >> EPOCH_SHIFT:
            raise RejectedFrame("another run", f"exchange epoch {seq >> EPOCH_SHIFT}, this run's is {self._epoch >> EPOCH_SHIFT}")
        seq &= (1 << EPOCH_SHIFT) - 1
        if seq <= self._closed_seq:
            self.stats["stale_frames"] += 1  # a late sender's frame for an exchange already closed here
            return
        if seq > self.current_seq + self.limits.max_ahead:
            raise RejectedFrame("too far ahead", f"exchange {seq}, this peer is at {self.current_seq}")
        if kind == KIND_MESSAGE:
            try:
                exchange, round_index, message = decode(body, self.limits.max_message_bytes)
            except MessageFormatError as exc:
                raise RejectedFrame("malformed message", str(exc)) from None
            if int(message.src[0]) != node:
                raise RejectedFrame("spoofed source", f"node {int(message.src[0])} on the connection of {source} (node {node})")
            if int(message.dst[0]) != self.me.node:
                raise RejectedFrame("wrong destination", f"node {int(message.dst[0])}, this is node {self.me.node}")
            if len(exchange) > 200:
                raise RejectedFrame("malformed message", "exchange name too long")
        else:
            marker = load_json(body, MARKER_FIELDS)
            if not 0 <= marker["count"] <= 10_000_000 or len(marker["exchange"]) > 200 or len(marker["phase"]) > 200:
                raise RejectedFrame("malformed marker", "count or names out of range")
        batches = self._batches.setdefault(seq, {})
        batch = batches.get(source)
        if batch is None or batch.connection != connection.id:
            if batch is not None:  # the sender reconnected and resends the whole batch
                self._buffered[source] -= batch.nbytes
            batch = batches[source] = _Batch(connection.id, started=connection.frame_at)
        if batch.marker is not None:
            raise RejectedFrame("frame after its end marker")
        batch.wire += HEADER_BYTES + len(body)
        if kind == KIND_MESSAGE:
            full = self._buffer_full(source, len(body))
            if full is not None:
                raise full
            batch.messages.append((exchange, round_index, message, len(body)))
            batch.nbytes += len(body)
            self._buffered[source] += len(body)
        else:
            batch.marker = marker
            batch.done_at = asyncio.get_running_loop().time()
            self._arrival.set()

    async def _serve_launcher(self, connection: FrameConnection) -> None:
        if self._launcher is not None:
            self._launcher.abort()
        self._launcher = connection

        async def handle(kind: int, seq: int, body: bytes) -> None:
            if kind != KIND_CONTROL:
                raise RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from the launcher")
            message = load_json(body, {"type": str})
            if message["type"] == "ping":
                pong = dump_json({"type": "pong", "peer": self.me.id})
                await connection.send([(KIND_REPORT, 0, pong)], self.limits.send_timeout_s, self.shaper)
            elif message["type"] == "drop":  # handled here: the node's driver may be busy for a whole round
                await self._refuse(str(message.get("peer")))
            else:
                self.control.put(message)

        try:
            await self._frames(connection, handle, launcher=True)
        finally:
            if self._launcher is connection:
                self._launcher = None
                self.control.put({"type": "launcher-closed"})

    def _gone(self, peer: str) -> bool:
        """A peer the launcher dropped, or one that connected in this run and closed every
        connection (not one whose last connection this side ended: it reconnects to send)."""
        if peer in self._gate.refused or peer in self._misbehaved:  # dropped, or cut for misbehaving (`liveness`)
            return True
        return peer in self._seen and not self._gate.inbound.get(peer) and peer not in self._cut

    # -- exchanges ------------------------------------------------------------------------
    def exchange(
        self, seq: int, outgoing: dict[str, list[bytes]], marker: dict[str, Any], expected: set[str], targets: set[str]
    ) -> ExchangeResult:
        """Send `outgoing[dst]` frames plus an end marker to every target, and wait for
        the complete batch of every expected sender (or its absence)."""
        limit = self.limits.exchange_timeout_s + (self.limits.retries + 2) * (self.limits.send_timeout_s + self.limits.connect_timeout_s)
        return self._thread.call(self._exchange(seq, outgoing, marker, expected, targets), timeout=limit + 30)

    async def _exchange(
        self, seq: int, outgoing: dict[str, list[bytes]], marker: dict[str, Any], expected: set[str], targets: set[str]
    ) -> ExchangeResult:
        loop = asyncio.get_running_loop()
        self.current_seq = seq
        for old in [s for s in self._batches if s < seq]:
            for source, batch in self._batches.pop(old).items():
                self._buffered[source] -= batch.nbytes
        deadline = loop.time() + self.limits.exchange_timeout_s
        refused = targets & self._gate.refused  # dropped (by the launcher, or as slow): nothing goes to them any more
        sends = {
            dst: asyncio.create_task(self._send_batch(dst, seq, outgoing.get(dst, []), marker))
            for dst in sorted(targets - self._unreachable - refused)
        }
        for dst in sorted(set(outgoing) - set(sends)):
            if outgoing[dst]:
                why = self._gate.refused_why.get(dst, "unreachable this round")
                log.warning("exchange %s: %d message(s) for %s not sent: %s", marker.get("exchange"), len(outgoing[dst]), dst,
                            why)
        await self._await_markers(seq, expected, deadline)
        sent = {dst: await task for dst, task in sends.items()}
        batches = self._batches.pop(seq, {})
        for source, batch in batches.items():
            self._buffered[source] -= batch.nbytes
        received = {s: (b.marker, b.messages) for s, b in batches.items() if s in expected and b.marker is not None}
        self._closed_seq = seq
        dropped = self._slow.judge(self._arrivals(expected, batches), self.limits,
                                   {"seq": seq, **{k: marker.get(k) for k in ("phase", "round", "exchange")}})
        for entry in dropped:
            await self._refuse(entry["peer"], SLOW_DROP_REASON)
        unreachable = {dst for dst, nbytes in sent.items() if nbytes is None} | refused
        self._unreachable |= unreachable
        return ExchangeResult(received, set(expected) - set(received), unreachable, sum(n for n in sent.values() if n),
                              dropped)

    def _arrivals(self, expected: set[str], batches: dict[str, _Batch]) -> dict[str, Arrival]:
        """How each expected sender's batch arrived, for the slow-peer policy; not judged: a
        sender that was dropped, or that left (closed every connection, not cut by this side)."""
        arrivals: dict[str, Arrival] = {}
        for peer in expected - self._gate.refused:
            batch = batches.get(peer)
            if batch is not None and batch.marker is not None:
                arrivals[peer] = Arrival(True, batch.wire, batch.done_at - batch.started)
            elif peer in self._misbehaved:
                arrivals[peer] = Arrival(False, cut=self._misbehaved[peer])
            elif not self._gone(peer):
                arrivals[peer] = Arrival(False)
        return arrivals

    async def _await_markers(self, seq: int, expected: set[str], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._arrival.clear()
            waiting = [
                s for s in expected
                if not (self._batches.get(seq, {}).get(s) is not None and self._batches[seq][s].marker is not None) and not self._gone(s)
            ]
            remaining = deadline - loop.time()
            if not waiting or remaining <= 0:
                if waiting:
                    log.warning(
                        "exchange %d: no end marker from %s within %.1f s", seq, ", ".join(sorted(waiting)), self.limits.exchange_timeout_s
                    )
                return
            try:
                await asyncio.wait_for(self._arrival.wait(), remaining)
            except TimeoutError:
                pass

    async def _send_batch(self, dst: str, seq: int, frames: list[bytes], marker: dict[str, Any]) -> int | None:
        """Bytes written, or None when every attempt failed (bounded retries, backoff)."""
        wire = self._epoch | seq
        payload = [(KIND_MESSAGE, wire, f) for f in frames] + [(KIND_END, wire, dump_json({**marker, "count": len(frames)}))]
        attempts = 1 if self._gone(dst) else 1 + self.limits.retries  # a peer seen leaving gets one try per round
        failure: BaseException | None = None
        for attempt in range(attempts):
            try:
                connection = await self._outbound(dst)
                written = await connection.send(payload, self.limits.send_timeout_s, self.shaper)
                self.stats["wire_bytes_sent"] += written
                self.stats["frames_sent"] += len(payload)
                return written
            except NETWORK_ERRORS as exc:
                failure = exc
                stale = self._out.pop(dst, None)
                if stale is not None:
                    stale.close()
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.limits.backoff_s * 2**attempt)
        log.warning("could not send exchange %d to %s after %d attempt(s): %r", seq, dst, attempts, failure)
        return None

    async def _outbound(self, dst: str) -> FrameConnection:
        loop = asyncio.get_running_loop()
        connection = self._out.get(dst)
        if connection is not None and not connection.closed:
            if loop.time() - connection.last_sent < self.limits.idle_timeout_s / 2:
                return connection
            # The receiver closes a connection idle for idle_timeout_s; frames written as it does would be
            # lost, so take a fresh one well before. The old one is left for the receiver to close: closing it
            # here could make the receiver, still waiting for this batch, think this peer left.
            loop.call_later(self.limits.idle_timeout_s, connection.close)
        spec = self.peers.by_id[dst]
        connection = await open_frames(spec.host, spec.port, self.client_context, dst, self.limits)
        self._out[dst] = connection
        loop.create_task(self._watch_outbound(connection))
        return connection

    async def _watch_outbound(self, connection: FrameConnection) -> None:
        """Peers never answer on a data connection: anything read is rejected, EOF closes it."""
        try:
            while await connection.reader.read(65536):
                self.rejects.reject("data on an outbound connection", connection.name)
        except NETWORK_ERRORS:
            pass
        finally:
            connection.close()

    # -- reports to the launcher -----------------------------------------------------
    def report(self, message: dict[str, Any], state: bytes | None = None) -> bool:
        """Send a report (and optionally a state blob first) to the launcher."""
        try:
            return self._thread.call(self._report(message, state), timeout=self.limits.send_timeout_s + 10)
        except Exception as exc:  # noqa: BLE001
            log.warning("report %s not delivered: %r", message.get("type"), exc)
            return False

    def report_later(self, message: dict[str, Any]) -> None:
        """Queue a report without waiting for it to be written, so that a round's report
        does not hold up the next round. Reports leave in the order they were queued (the
        connection's lock is first come, first served); failures are logged."""
        asyncio.run_coroutine_threadsafe(self._report(message, None), self._thread.loop)

    async def _report(self, message: dict[str, Any], state: bytes | None) -> bool:
        connection = self._launcher
        if connection is None or connection.closed:
            log.warning("report %s not delivered: the launcher is not connected", message.get("type"))
            return False
        frames = ([(KIND_STATE, 0, state)] if state is not None else []) + [(KIND_REPORT, 0, dump_json(message))]
        try:
            written = await connection.send(frames, self.limits.send_timeout_s, self.shaper)
        except NETWORK_ERRORS as exc:
            log.warning("report %s not delivered: %r", message.get("type"), exc)
            return False
        self.stats["wire_bytes_sent_launcher"] += written
        return True
