"""Connections of the device transport and who gets in: frame connections, the admission
of inbound ones (`Gate`), the reject log, the shaping hook's interface, the loop thread.

Admission happens in two stages. Before its TLS handshake completes a connection is
anonymous: it only costs a socket and a handshake, so it gets a small, separate budget
per source address and in total (`HandshakeBudget`), and a short handshake timeout.
When that budget is full the *oldest* pending handshake is evicted rather than the
newcomer refused: a flood of idle sockets then only ever evicts itself, while an honest
client, whose handshake takes milliseconds, completes long before it becomes the
oldest. Authenticated connections count against their own caps (`max_connections` in
total, `max_connections_per_identity` per certificate name, where one identity beyond its
cap loses its oldest connection, so it can only crowd out itself), never against this
budget; an identity the launcher dropped is refused after its handshake.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from p4bench.plugins.device.protocol import HEADER_BYTES, Limits, frame_header
from p4bench.plugins.device.tls import IdentityError, common_name

log = logging.getLogger("p4bench.device")

__all__ = ["NETWORK_ERRORS", "FrameConnection", "open_frames", "Gate", "HandshakeBudget", "RejectLog", "LoopThread", "Shaper",
           "close_on_loop"]

NETWORK_ERRORS = (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, IdentityError)


class Shaper(Protocol):
    """Link shaping (`plugins/device/link.py`): called after each frame is written."""

    async def pace(self, nbytes: int) -> None:
        """Wait as long as the shaped link needs to carry `nbytes` more bytes."""


class FrameConnection:
    """One authenticated TLS stream carrying frames."""

    _ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.id = next(self._ids)
        self.lock = asyncio.Lock()
        self.bytes_sent = 0
        self.last_sent = asyncio.get_running_loop().time()  # opened, or last frames written (loop clock)

    async def send(self, frames: list[tuple[int, int, bytes]], timeout: float, shaper: Shaper | None = None) -> int:
        """Write (kind, seq, body) frames and wait until they are handed to the OS; with a
        `shaper`, pace each frame's bytes through it (an emulated link)."""
        async with self.lock:
            total = 0
            for kind, seq, body in frames:
                self.writer.write(frame_header(kind, seq, len(body)))
                self.writer.write(body)
                total += HEADER_BYTES + len(body)
                if shaper is not None:
                    await shaper.pace(HEADER_BYTES + len(body))
            await asyncio.wait_for(self.writer.drain(), timeout)
            self.bytes_sent += total
            self.last_sent = asyncio.get_running_loop().time()
            return total

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    def abort(self) -> None:
        """Close at once: a TLS close waits (up to 30 s) for the other end's close_notify."""
        self.writer.transport.abort()


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


class Gate:
    """Admission of a listening peer's inbound connections (see the module docstring).

    `limits` is read at every admission (a run's limits replace the defaults); `allowed`
    says whether a certificate name may connect at all. Both handshake bounds are at least
    `burst`, the peers of the run: the launcher and every other peer may connect at once,
    all from one address in a local run, and must not evict each other. Used on the loop only."""

    def __init__(self, server_context: ssl.SSLContext, limits: Callable[[], Limits], rejects: RejectLog,
                 allowed: Callable[[str], bool], burst: int = 1) -> None:
        self.server_context, self._limits, self.rejects, self._allowed = server_context, limits, rejects, allowed
        self.burst = burst
        self.handshakes = HandshakeBudget()
        self.inbound: dict[str, dict[int, FrameConnection]] = {}  # authenticated, per identity, oldest first
        self.count = 0  # authenticated connections open
        self.refused: set[str] = set()  # identities refused after their handshake (dropped by the launcher)

    async def enter(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> FrameConnection | None:
        """TLS handshake (within the budget and its timeout), identity, caps: the registered
        connection, or None when rejected (counted). Raises CancelledError when evicted."""
        limits = self._limits()
        peername = writer.get_extra_info("peername")
        address = str(peername)
        source = str(peername[0]) if isinstance(peername, tuple) and peername else address
        task = asyncio.current_task()
        assert task is not None
        per_source = max(limits.max_handshakes_per_source, self.burst)
        evicted = self.handshakes.admit(task, source, task.cancel, per_source, max(limits.max_handshakes, per_source))
        for reason, victim in evicted:
            self.rejects.reject(reason, victim, "closing its oldest pending handshake")
        try:
            async with asyncio.timeout(limits.handshake_timeout_s):  # the SSL layer's own timer is only a backstop
                await writer.start_tls(self.server_context, ssl_handshake_timeout=limits.handshake_timeout_s + 1)
        except TimeoutError:
            self.rejects.reject("TLS handshake timeout", address, f"not done within {limits.handshake_timeout_s} s")
            return None
        except (*NETWORK_ERRORS, ValueError) as exc:
            self.rejects.reject("TLS handshake (no valid certificate of this run)", address, repr(exc))
            return None
        finally:
            self.handshakes.release(task)
        name = common_name(writer.get_extra_info("peercert"))
        if name is None or not self._allowed(name):
            self.rejects.reject("unknown identity", address, f"certificate name {name!r} is not in the peers file")
            return None
        if name in self.refused:
            self.rejects.reject("dropped by the launcher", name, f"connection from {address} refused")
            return None
        if self.count >= limits.max_connections:
            self.rejects.reject("connection limit", name, f"{self.count} authenticated connections open")
            return None
        same = self.inbound.setdefault(name, {})
        live = [c for c in same.values() if not c.closed]
        for old in live[: max(len(live) - limits.max_connections_per_identity + 1, 0)]:
            self.rejects.reject("connections per identity", name, f"over {limits.max_connections_per_identity}: oldest closed")
            old.abort()
        connection = FrameConnection(reader, writer, name)
        same[connection.id] = connection
        self.count += 1
        return connection

    def leave(self, connection: FrameConnection) -> None:
        """Forget a connection `enter` returned (its task ended)."""
        same = self.inbound.get(connection.name, {})
        if same.pop(connection.id, None) is not None:
            self.count -= 1
        if not same:
            self.inbound.pop(connection.name, None)

    def refuse(self, name: str) -> bool:
        """Refuse `name` from now on and close its connections; False if it already was."""
        if name in self.refused:
            return False
        self.refused.add(name)
        for connection in list(self.inbound.get(name, {}).values()):
            connection.abort()
        return True


class HandshakeBudget:
    """Pending TLS handshakes, at most `per_source` per source address and `total` in all.

    `admit` registers a handshake; beyond either bound it first evicts the oldest pending
    handshake of that source (or, for the total, the oldest of all) by calling the
    `evict` callback it was registered with. Not thread-safe: used on the loop only."""

    def __init__(self) -> None:
        self._pending: dict[object, tuple[str, Callable[[], object]]] = {}  # insertion order = age
        self._per_source: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, key: object, source: str, evict: Callable[[], object], per_source: int, total: int) -> list[tuple[str, str]]:
        """Register the handshake `key` from `source`, within `per_source` of its source and
        `total` in all; returns (reason, source) of each handshake evicted to make room."""
        evicted: list[tuple[str, str]] = []
        while self._per_source[source] >= per_source:
            oldest = next(k for k, (s, _) in self._pending.items() if s == source)
            evicted.append(("handshake evicted (per-source budget full)", self._evict(oldest)))
        while len(self._pending) >= total:
            evicted.append(("handshake evicted (handshake budget full)", self._evict(next(iter(self._pending)))))
        self._pending[key] = (source, evict)
        self._per_source[source] += 1
        return evicted

    def release(self, key: object) -> None:
        """The handshake `key` finished (or failed, or was evicted): free its slot."""
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._forget(entry[0])

    def _evict(self, key: object) -> str:
        source, evict = self._pending.pop(key)
        self._forget(source)
        evict()
        return source

    def _forget(self, source: str) -> None:
        self._per_source[source] -= 1
        if self._per_source[source] <= 0:
            del self._per_source[source]


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

    def reset(self) -> dict[str, int]:
        """Start counting afresh; returns the counts until now."""
        with self._lock:
            counts, self.counts = dict(self.counts), Counter()
            return counts


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


def close_on_loop(thread: LoopThread, close_all: Callable[[], object]) -> None:
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
