"""The receiving side of a peer's transport (`Inbound`): the connections other peers and
the launcher open to it, the frames read from them, and the batches buffered per exchange.

Runs on the transport's loop thread only (`transport.PeerTransport` owns it). A peer's
data frames carry the exchange `seq` on the wire, with the run's epoch in its top bits
(`EPOCH_SHIFT`), so frames of another run never mix in. A sender's batch of an exchange is
complete when its end marker arrives; what is buffered is capped per sender and in total
(`Limits.buffer_caps`), bodies being read counting as buffered. A sender whose connection
this side cut for misbehaving is not waited for until it reconnects; one the launcher
dropped, or that this peer dropped as slow, is refused (`refuse`). The batches and who an
exchange still waits for are its base `InboundBatches` (`inbound_batches`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from p4bench_device.admission import NETWORK_ERRORS, FrameConnection, Gate, RejectLog, Shaper
from p4bench_device.inbound_batches import (  # re-exported: defined here before
    EPOCH_SHIFT,
    MARKER_FIELDS,
    Batch,
    InboundBatches,
    Received,
)
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import (
    HEADER_BYTES,
    KIND_CONTROL,
    KIND_END,
    KIND_MESSAGE,
    KIND_REPORT,
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
from p4bench_device.tls import LAUNCHER

log = logging.getLogger("p4bench.device")

__all__ = ["Inbound", "Batch", "Received", "EPOCH_SHIFT", "MARKER_FIELDS"]


class Inbound(InboundBatches):
    """What reaches one peer (see the module docstring). `limits` and `shaper` are read at
    every use (a run's replace the defaults); `control` receives the launcher's control
    messages other than ping and drop; `on_refuse(peer)` is called when a peer is refused
    (the transport stops sending to it)."""

    def __init__(
        self,
        me: PeerSpec,
        peers: PeersFile,
        server_context: ssl.SSLContext,
        limits: Callable[[], Limits],
        shaper: Callable[[], Shaper | None],
        rejects: RejectLog,
        stats: Counter[str],
        control: queue.Queue[dict[str, Any]],
        on_refuse: Callable[[str], None],
    ) -> None:
        self.me, self.peers, self._limits, self._shaper = me, peers, limits, shaper
        self.rejects, self.stats, self.control, self._on_refuse = rejects, stats, control, on_refuse
        super().__init__()
        self.launcher: FrameConnection | None = None
        self.gate = Gate(
            server_context,
            limits,
            rejects,
            lambda name: name == LAUNCHER or (name in peers.by_id and name != me.id),
            len(peers.peers),
        )
        self.run_active = False

    def reset(self, epoch: int) -> None:
        """A new run starts: forget every batch, connection history and refusal; accept data frames."""
        self.drop_buffers()
        self.seen.clear()
        self.cut.clear()
        self.misbehaved.clear()
        self.gate.refused.clear()
        self.gate.refused_why.clear()
        self.model_bytes = 0
        self.current_seq = self.closed_seq = 0
        self.epoch = epoch
        self.run_active = True

    async def refuse(self, peer: str, why: str = "dropped by the launcher") -> None:
        """Refuse `peer` for the rest of this run: its connections closed, new ones refused,
        its buffered frames dropped, exchanges no longer wait for it. RejectedFrame for an unknown peer."""
        if peer not in self.peers.by_id or peer == self.me.id:
            raise RejectedFrame("malformed control", f"drop of unknown peer {peer[:60]!r}")
        if not self.gate.refuse(peer, why):
            return
        log.warning("peer %s %s: refused for the rest of this run", peer, why)
        self._on_refuse(peer)
        for batches in self.batches.values():
            batch = batches.pop(peer, None)
            if batch is not None:
                self.buffered[peer] -= batch.nbytes
        self.arrival.set()

    # -- accepting connections --------------------------------------------------------
    async def accept(self, sock: socket.socket, address: Any) -> None:
        """Serve one accepted socket until its connection ends (the listener's handler)."""
        connection: FrameConnection | None = None
        try:
            connection = await self.gate.enter(sock, address)
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
                self.gate.leave(connection)
                connection.abort()  # the other end left or misbehaved: no TLS goodbye (it could hold the socket 30 s)

    def _body_limit(self, launcher: bool) -> tuple[int, str]:
        """(largest frame body read now on a connection, why)."""
        if launcher:
            return MAX_JSON_BYTES, "control messages are JSON"
        if not self.run_active:
            return MAX_IDLE_BODY_BYTES, "no run active"
        per_sender = self.buffer_caps()[0]
        return min(
            self._limits().max_message_bytes, per_sender
        ), f"per-sender buffer cap {per_sender}"

    def _refusal(self, source: str, kind: int, length: int) -> RejectedFrame | None:
        """Why a peer's frame is rejected before its body is read (None: read it)."""
        if kind not in (KIND_MESSAGE, KIND_END):
            return RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from a peer")
        if not self.run_active:
            return RejectedFrame("no run active", f"{length}-byte {chr(kind)!r} frame")
        if source in self.gate.refused:
            return RejectedFrame(
                self.gate.refused_why.get(source, "dropped by the launcher"), "frame refused"
            )
        if kind == KIND_END and length > MAX_JSON_BYTES:
            return RejectedFrame("oversized JSON", f"{length} bytes > {MAX_JSON_BYTES}")
        if kind == KIND_MESSAGE:
            return self.buffer_full(source, length)
        return None

    async def _frames(
        self,
        connection: FrameConnection,
        handle: Callable[[int, int, bytes], Awaitable[None] | None],
        launcher: bool = False,
    ) -> str | None:
        """Read frames until the stream ends; reject bad ones (unread where possible); stop on
        broken framing, on an oversized frame, when idle or when a frame body trickles in.
        Why this side ended the connection ("idle", or the misbehaviour), None when the other end did."""
        source, reader, frames = connection.name, connection.reader, 0
        while True:
            limits = (
                self._limits()
            )  # a run's limits replace the defaults, also on connections already open
            try:
                async with asyncio.timeout(limits.idle_timeout_s):
                    hard_cap = MAX_JSON_BYTES if launcher else limits.max_message_bytes
                    version, kind, seq, length = await read_header(reader, hard_cap)
            except TimeoutError:
                if frames:  # a sender between exchanges (it takes a fresh connection after idle_timeout_s / 2)
                    self.stats["idle_closed"] += 1
                else:  # silent since its handshake
                    self.rejects.reject(
                        "idle connection",
                        source,
                        f"no frame for {limits.idle_timeout_s} s; closing the connection",
                    )
                return "idle"
            except FrameError as exc:
                self.rejects.reject("broken framing", source, f"{exc}; closing the connection")
                return "broken framing"
            except (*NETWORK_ERRORS, ValueError):
                return None
            connection.frame_at = asyncio.get_running_loop().time()
            limit, why = self._body_limit(launcher)
            if length > limit:
                self.rejects.reject(
                    "oversized frame",
                    source,
                    f"{length} bytes > {limit} ({why}); closing the connection",
                )
                return "oversized frame"
            problem = header_problem(version, kind) or (
                None if launcher else self._refusal(source, kind, length)
            )
            reserved = length if problem is None and kind == KIND_MESSAGE else 0
            self.reading[source] += reserved  # bodies being read count against the buffer caps
            deadline = min(limits.idle_timeout_s, 10.0) + length / limits.min_rate_bytes_s
            try:
                async with asyncio.timeout(deadline):
                    body = await (
                        skip_body(reader, length) if problem else reader.readexactly(length)
                    )
            except TimeoutError:
                self.rejects.reject(
                    "slow frame",
                    source,
                    f"{length}-byte body not in within {deadline:.1f} s; closing",
                )
                return "slow frame"
            except (*NETWORK_ERRORS, ValueError):
                return None
            finally:
                self.reading[source] -= reserved
            frames += 1
            if problem is not None:
                self.rejects.reject(problem.reason, source, problem.detail)
                continue
            self.stats["wire_bytes_received"] += HEADER_BYTES + length
            self.stats["frames_received"] += 1
            try:
                result = handle(kind, seq, body)
                if result is not None:
                    await result
            except RejectedFrame as exc:
                self.rejects.reject(exc.reason, source, exc.detail)

    async def _serve_peer(self, connection: FrameConnection) -> None:
        name = connection.name
        node = self.peers.by_id[name].node
        self.seen.add(name)
        self.misbehaved.pop(name, None)  # a new connection: waited for again
        cut: str | None = None
        try:
            cut = await self._frames(
                connection,
                lambda kind, seq, body: self._accept_data(connection, node, kind, seq, body),
            )
        finally:
            if cut:  # it may well reconnect to send (an idle connection, say): not taken for gone
                self.cut.add(name)
            else:
                self.cut.discard(name)
            others = [
                c
                for c in self.gate.inbound.get(name, {}).values()
                if c is not connection and not c.closed
            ]
            if (
                cut and cut != "idle" and not others
            ):  # cut for misbehaving: not waited for until it reconnects
                self.misbehaved[name] = cut
            self.arrival.set()

    async def _serve_launcher(self, connection: FrameConnection) -> None:
        if self.launcher is not None:
            self.launcher.abort()
        self.launcher = connection

        async def handle(kind: int, seq: int, body: bytes) -> None:
            if kind != KIND_CONTROL:
                raise RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from the launcher")
            message = load_json(body, {"type": str})
            if message["type"] == "ping":
                pong = dump_json({"type": "pong", "peer": self.me.id})
                await connection.send(
                    [(KIND_REPORT, 0, pong)], self._limits().send_timeout_s, self._shaper()
                )
            elif (
                message["type"] == "drop"
            ):  # handled here: the node's driver may be busy for a whole round
                await self.refuse(str(message.get("peer")))
            else:
                self.control.put(message)

        try:
            await self._frames(connection, handle, launcher=True)
        finally:
            if self.launcher is connection:
                self.launcher = None
                self.control.put({"type": "launcher-closed"})
