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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import ssl
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p4bench.engine.messages import MessageFormatError, Messages, decode
from p4bench.plugins.device.peers import PeersFile, PeerSpec
from p4bench.plugins.device.protocol import (
    HEADER_BYTES,
    KIND_CONTROL,
    KIND_END,
    KIND_MESSAGE,
    KIND_REPORT,
    KIND_STATE,
    FrameError,
    Limits,
    RejectedFrame,
    dump_json,
    frame_header,
    load_json,
    read_frame,
)
from p4bench.plugins.device.tls import LAUNCHER, IdentityError, client_context, common_name, server_context

log = logging.getLogger("p4bench.device")

_NETWORK_ERRORS = (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, IdentityError)
MARKER_FIELDS = {"exchange": str, "round": int, "phase": str, "count": int}
EPOCH_SHIFT = 40  # wire seq = run epoch (24 bits) << 40 | exchange number


class RejectLog:
    """Counts rejected input per reason; logs the first few of each, then every 1000th."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def reject(self, reason: str, source: str, detail: str = "") -> None:
        with self._lock:
            self.counts[reason] += 1
            count = self.counts[reason]
        if count <= 10 or count % 1000 == 0:
            log.warning("rejected %s from %s: %s (%d so far)", reason, source, detail[:200], count)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                self.call(cancel_all(), timeout=10)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class FrameConnection:
    """One authenticated TLS stream carrying frames."""

    _ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.id = next(self._ids)
        self.lock = asyncio.Lock()
        self.bytes_sent = 0

    async def send(self, frames: list[tuple[int, int, bytes]], timeout: float) -> int:
        """Write (kind, seq, body) frames and wait until they are handed to the OS."""
        async with self.lock:
            total = 0
            for kind, seq, body in frames:
                self.writer.write(frame_header(kind, seq, len(body)))
                self.writer.write(body)
                total += HEADER_BYTES + len(body)
            await asyncio.wait_for(self.writer.drain(), timeout)
            self.bytes_sent += total
            return total

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


async def open_frames(host: str, port: int, context: ssl.SSLContext, expected: str, limits: Limits) -> FrameConnection:
    """Connect with TLS and check that the server is `expected` (its certificate's name)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=context, ssl_handshake_timeout=limits.connect_timeout_s),
        limits.connect_timeout_s,
    )
    name = common_name(writer.get_extra_info("peercert"))
    if name != expected:
        writer.close()
        raise IdentityError(f"{host}:{port} presented the certificate of {name!r}, expected {expected!r}")
    return FrameConnection(reader, writer, name)


@dataclass
class _Batch:
    """What one sender sent for one exchange, on one connection."""

    connection: int
    messages: list[tuple[str, int, Messages, int]] = field(default_factory=list)  # exchange, round, message, frame bytes
    marker: dict[str, Any] | None = None
    nbytes: int = 0


@dataclass
class ExchangeResult:
    received: dict[str, tuple[dict[str, Any], list[tuple[str, int, Messages, int]]]]  # sender -> (marker, messages)
    absent: set[str]  # expected senders whose batch did not complete
    unreachable: set[str]  # destinations that could not be sent to
    wire_bytes_sent: int = 0


class PeerTransport:
    """The network side of one peer (see the module docstring)."""

    def __init__(self, me: PeerSpec, peers: PeersFile, tls_dir: str | Path, limits: Limits) -> None:
        self.me, self.peers, self.limits = me, peers, limits
        self.server_context = server_context(tls_dir, me.id)
        self.client_context = client_context(tls_dir, me.id)
        self.rejects = RejectLog()
        self.control: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stats: Counter[str] = Counter()
        # owned by the loop thread:
        self._batches: dict[int, dict[str, _Batch]] = {}
        self._buffered: Counter[str] = Counter()
        self._open: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._out: dict[str, FrameConnection] = {}
        self._unreachable: set[str] = set()
        self._launcher: FrameConnection | None = None
        self._connections = 0
        self.current_seq = 0
        self._closed_seq = 0
        self._epoch = 0  # high bits of every wire seq: frames of another run never mix in
        self._server: asyncio.AbstractServer | None = None
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
        self._server = await asyncio.start_server(self._accept, host, port, limit=2**16)
        return int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        def close_all() -> None:
            if self._server is not None:
                self._server.close()
            for connection in [*self._out.values(), *([self._launcher] if self._launcher else [])]:
                connection.close()

        _close_on_loop(self._thread, close_all)

    def begin_run(self, run_id: str = "") -> None:
        """Forget every buffered frame and connection history: a new run starts. Exchange
        numbers on the wire carry the run's epoch (from its id) in their top 24 bits."""

        async def reset() -> None:
            self._batches.clear()
            self._buffered.clear()
            self._seen.clear()
            self._unreachable.clear()
            self.current_seq = self._closed_seq = 0
            self._epoch = (zlib.crc32(run_id.encode()) & 0xFFFFFF) << EPOCH_SHIFT

        self._thread.call(reset(), timeout=10)

    def new_round(self) -> None:
        """Destinations that failed in the last round get another chance (rejoin)."""

        async def reset() -> None:
            self._unreachable.clear()

        self._thread.call(reset(), timeout=10)

    def snapshot(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            return {**self.stats, "rejected": self.rejects.snapshot()}

        return self._thread.call(read(), timeout=10)

    # -- accepting connections --------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = str(writer.get_extra_info("peername"))
        if self._connections >= self.limits.max_connections:
            self.rejects.reject("connection limit", address)
            writer.close()
            return
        self._connections += 1
        try:
            try:
                await writer.start_tls(self.server_context, ssl_handshake_timeout=self.limits.connect_timeout_s)
            except (*_NETWORK_ERRORS, ValueError) as exc:
                self.rejects.reject("TLS handshake (no valid certificate of this run)", address, repr(exc))
                return
            name = common_name(writer.get_extra_info("peercert"))
            if name != LAUNCHER and (name not in self.peers.by_id or name == self.me.id):
                self.rejects.reject("unknown identity", address, f"certificate name {name!r} is not in the peers file")
                return
            connection = FrameConnection(reader, writer, name)
            if name == LAUNCHER:
                await self._serve_launcher(connection)
            else:
                await self._serve_peer(connection)
        except asyncio.CancelledError:
            return  # shutting down: end the connection's task quietly
        except Exception as exc:  # noqa: BLE001 - nothing a remote sends may end the peer
            log.exception("connection from %s failed: %s", address, exc)
        finally:
            self._connections -= 1
            writer.close()

    async def _frames(self, connection: FrameConnection, handle: Callable[[int, int, bytes], Any]) -> None:
        """Read frames until the stream ends; reject bad ones; close on broken framing."""
        source = connection.name
        while True:
            try:
                kind, seq, body = await read_frame(connection.reader, self.limits.max_message_bytes)
            except RejectedFrame as exc:
                self.rejects.reject(exc.reason, source, exc.detail)
                continue
            except FrameError as exc:
                self.rejects.reject("broken framing", source, f"{exc}; closing the connection")
                return
            except (*_NETWORK_ERRORS, ValueError):
                return
            self.stats["wire_bytes_received"] += HEADER_BYTES + len(body)
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
        self._open[name] += 1
        self._seen.add(name)
        try:
            await self._frames(connection, lambda kind, seq, body: self._accept_data(connection, node, kind, seq, body))
        finally:
            self._open[name] -= 1
            self._arrival.set()

    def _accept_data(self, connection: FrameConnection, node: int, kind: int, seq: int, body: bytes) -> None:
        source = connection.name
        self._seen.add(source)
        if kind not in (KIND_MESSAGE, KIND_END):
            raise RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from a peer")
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
            batch = batches[source] = _Batch(connection.id)
        if batch.marker is not None:
            raise RejectedFrame("frame after its end marker")
        if kind == KIND_MESSAGE:
            if self._buffered[source] + len(body) > self.limits.max_buffered_bytes:
                raise RejectedFrame("buffer full", f"{self._buffered[source]} bytes from {source} not consumed yet")
            batch.messages.append((exchange, round_index, message, len(body)))
            batch.nbytes += len(body)
            self._buffered[source] += len(body)
        else:
            batch.marker = marker
            self._arrival.set()

    async def _serve_launcher(self, connection: FrameConnection) -> None:
        if self._launcher is not None:
            self._launcher.close()
        self._launcher = connection

        async def handle(kind: int, seq: int, body: bytes) -> None:
            if kind != KIND_CONTROL:
                raise RejectedFrame("frame kind not allowed", f"{chr(kind)!r} from the launcher")
            message = load_json(body, {"type": str})
            if message["type"] == "ping":
                await connection.send([(KIND_REPORT, 0, dump_json({"type": "pong", "peer": self.me.id}))], self.limits.send_timeout_s)
            else:
                self.control.put(message)

        try:
            await self._frames(connection, handle)
        finally:
            if self._launcher is connection:
                self._launcher = None
                self.control.put({"type": "launcher-closed"})

    def _gone(self, peer: str) -> bool:
        """A peer that connected in this run and has no open connection left."""
        return peer in self._seen and self._open[peer] <= 0

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
        sends = {
            dst: asyncio.create_task(self._send_batch(dst, seq, outgoing.get(dst, []), marker))
            for dst in sorted(targets - self._unreachable)
        }
        for dst in sorted(set(outgoing) - set(sends)):
            if outgoing[dst]:
                log.warning(
                    "exchange %s: %d message(s) for %s not sent: unreachable this round", marker.get("exchange"), len(outgoing[dst]), dst
                )
        await self._await_markers(seq, expected, deadline)
        sent = {dst: await task for dst, task in sends.items()}
        batches = self._batches.pop(seq, {})
        for source, batch in batches.items():
            self._buffered[source] -= batch.nbytes
        received = {s: (b.marker, b.messages) for s, b in batches.items() if s in expected and b.marker is not None}
        self._closed_seq = seq
        unreachable = {dst for dst, nbytes in sent.items() if nbytes is None}
        self._unreachable |= unreachable
        return ExchangeResult(received, set(expected) - set(received), unreachable, sum(n for n in sent.values() if n))

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
                written = await connection.send(payload, self.limits.send_timeout_s)
                self.stats["wire_bytes_sent"] += written
                self.stats["frames_sent"] += len(payload)
                return written
            except _NETWORK_ERRORS as exc:
                failure = exc
                stale = self._out.pop(dst, None)
                if stale is not None:
                    stale.close()
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.limits.backoff_s * 2**attempt)
        log.warning("could not send exchange %d to %s after %d attempt(s): %r", seq, dst, attempts, failure)
        return None

    async def _outbound(self, dst: str) -> FrameConnection:
        connection = self._out.get(dst)
        if connection is not None and not connection.closed:
            return connection
        spec = self.peers.by_id[dst]
        connection = await open_frames(spec.host, spec.port, self.client_context, dst, self.limits)
        self._out[dst] = connection
        asyncio.get_running_loop().create_task(self._watch_outbound(connection))
        return connection

    async def _watch_outbound(self, connection: FrameConnection) -> None:
        """Peers never answer on a data connection: anything read is rejected, EOF closes it."""
        try:
            while await connection.reader.read(65536):
                self.rejects.reject("data on an outbound connection", connection.name)
        except _NETWORK_ERRORS:
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

    async def _report(self, message: dict[str, Any], state: bytes | None) -> bool:
        connection = self._launcher
        if connection is None or connection.closed:
            log.warning("report %s not delivered: the launcher is not connected", message.get("type"))
            return False
        frames = ([(KIND_STATE, 0, state)] if state is not None else []) + [(KIND_REPORT, 0, dump_json(message))]
        try:
            written = await connection.send(frames, self.limits.send_timeout_s)
        except _NETWORK_ERRORS as exc:
            log.warning("report %s not delivered: %r", message.get("type"), exc)
            return False
        self.stats["wire_bytes_sent_launcher"] += written
        return True


class LauncherLink:
    """The launcher's connections to every peer: control out, reports in."""

    def __init__(self, peers: PeersFile, tls_dir: str | Path, limits: Limits) -> None:
        self.peers, self.limits = peers, limits
        self.context = client_context(tls_dir, LAUNCHER)
        self.events: queue.Queue[tuple[str, int | None, bytes]] = queue.Queue()  # (peer, kind or None at close, body)
        self.rejects = RejectLog()
        self._connections: dict[str, FrameConnection] = {}
        self._thread = LoopThread("p4bench-device-launcher")

    def connect_all(self, deadline_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Connect to every peer, retrying with backoff until `deadline_s` (peers may
        still be starting). `check` raises to give up early (a local peer exited)."""
        self._thread.call(self._connect_all(deadline_s, check), timeout=deadline_s + 30)

    async def _connect_all(self, deadline_s: float, check: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s

        async def one(spec: PeerSpec) -> None:
            delay = 0.05
            while True:
                check()
                try:
                    connection = await open_frames(spec.host, spec.port, self.context, spec.id, self.limits)
                except IdentityError:
                    raise
                except _NETWORK_ERRORS as exc:
                    if loop.time() + delay > deadline:
                        raise ConnectionError(f"peer {spec.id} at {spec.host}:{spec.port} not reachable: {exc!r}") from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                self._connections[spec.id] = connection
                loop.create_task(self._read(connection))
                return

        await asyncio.gather(*(one(spec) for spec in self.peers.peers))

    async def _read(self, connection: FrameConnection) -> None:
        try:
            while True:
                try:
                    kind, seq, body = await read_frame(connection.reader, self.limits.max_message_bytes)
                except RejectedFrame as exc:
                    self.rejects.reject(exc.reason, connection.name, exc.detail)
                    continue
                if kind not in (KIND_REPORT, KIND_STATE):
                    self.rejects.reject("frame kind not allowed from a peer", connection.name, chr(kind))
                    continue
                self.events.put((connection.name, kind, body))
        except FrameError as exc:
            self.rejects.reject("broken framing", connection.name, str(exc))
        except (*_NETWORK_ERRORS, ValueError):
            pass
        finally:
            connection.close()
            self.events.put((connection.name, None, b""))

    def send(self, peer: str, message: dict[str, Any]) -> bool:
        connection = self._connections.get(peer)
        if connection is None or connection.closed:
            return False

        async def write() -> bool:
            try:
                await connection.send([(KIND_CONTROL, 0, dump_json(message))], self.limits.send_timeout_s)
                return True
            except _NETWORK_ERRORS as exc:
                log.warning("control %s to %s failed: %r", message.get("type"), peer, exc)
                return False

        try:
            return self._thread.call(write(), timeout=self.limits.send_timeout_s + 10)
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        def close_all() -> None:
            for connection in self._connections.values():
                connection.close()

        _close_on_loop(self._thread, close_all)


def _close_on_loop(thread, close_all: Callable[[], object]) -> None:
    """Run `close_all` on the transport's event loop (10 s at most), then stop the loop;
    closing twice does nothing."""
    if not thread.loop.is_running():
        return  # already closed

    async def shutdown() -> None:
        close_all()

    try:
        thread.call(shutdown(), timeout=10)
    except Exception:  # noqa: BLE001  (closing is best effort: the peer may be gone)
        pass
    thread.stop()


def parse_report(body: bytes) -> dict[str, Any]:
    """A peer's JSON report (RejectedFrame if malformed)."""
    return load_json(body, {"type": str})
