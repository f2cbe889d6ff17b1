"""Connections of the device transport and who gets in: frame connections, the admission
of inbound ones (`Gate`), the reject log, the shaping hook's interface, the loop thread.

Admission happens in two stages. Before its TLS handshake completes a connection is
anonymous: it only costs a socket and a handshake, so it gets a small, separate budget
per source address and in total (`HandshakeBudget`), and a short handshake timeout.
When that budget is full, room is made by evicting the oldest *silent* connection (no
byte received yet: `listener`), else the oldest handshake that has stalled, rather than
refusing the newcomer: a flood of idle sockets then only ever evicts itself. A handshake
whose client is sending, or that the TLS layer has completed, is never evicted (a TLS 1.3
client counts the handshake complete once its last flight is sent; evicting it then
left the launcher with a connection that closed at once); when only such handshakes
are pending, the newcomer is refused and its client retries. Authenticated connections
count against their own caps (`max_connections` in total, `max_connections_per_identity`
per certificate name, where one identity beyond its cap loses its oldest connection, so
it can only crowd out itself), never against this budget; an identity the launcher
dropped, or this peer dropped as slow (`liveness`), is refused after its handshake.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from p4bench_device.listener import has_unread, tls_accept, wait_readable
from p4bench_device.protocol import HEADER_BYTES, Limits, frame_header
from p4bench_device.tls import IdentityError, identity

log = logging.getLogger("p4bench.device")

__all__ = [
    "NETWORK_ERRORS",
    "FrameConnection",
    "open_frames",
    "Gate",
    "HandshakeBudget",
    "RejectLog",
    "LoopThread",
    "Shaper",
    "close_on_loop",
]

T = TypeVar("T")
NETWORK_ERRORS = (
    OSError,
    ssl.SSLError,
    asyncio.TimeoutError,
    ConnectionError,
    asyncio.IncompleteReadError,
    IdentityError,
)


class Shaper(Protocol):
    """Link shaping (`plugins/p4bench_device/link.py`): called after each frame is written."""

    async def pace(self, nbytes: int) -> None:
        """Wait as long as the shaped link needs to carry `nbytes` more bytes."""


class FrameConnection:
    """One authenticated TLS stream carrying frames."""

    _ids = itertools.count(1)

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.id = next(self._ids)
        self.lock = asyncio.Lock()
        self.bytes_sent = 0
        self.last_sent = (
            asyncio.get_running_loop().time()
        )  # opened, or last frames written (loop clock)
        self.frame_at = 0.0  # loop time the header of the last frame read was (inbound connections)

    async def send(
        self, frames: list[tuple[int, int, bytes]], timeout: float, shaper: Shaper | None = None
    ) -> int:
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


async def open_frames(
    host: str, port: int, context: ssl.SSLContext, expected: str, limits: Limits
) -> FrameConnection:
    """Connect with TLS and check that the server is `expected` (its certificate's name)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            host, port, ssl=context, ssl_handshake_timeout=limits.connect_timeout_s
        ),
        limits.connect_timeout_s,
    )
    name = identity(writer)
    if name != expected:
        writer.close()
        raise IdentityError(
            f"{host}:{port} presented the certificate of {name!r}, expected {expected!r}"
        )
    return FrameConnection(reader, writer, name)


class Gate:
    """Admission of a listening peer's inbound connections (see the module docstring).

    `limits` is read at every admission (a run's limits replace the defaults); `allowed`
    says whether a certificate name may connect at all. Both handshake bounds are at least
    `burst`, the peers of the run: the launcher and every other peer may connect at once,
    all from one address in a local run, and must not evict each other. Used on the loop only."""

    def __init__(
        self,
        server_context: ssl.SSLContext,
        limits: Callable[[], Limits],
        rejects: RejectLog,
        allowed: Callable[[str], bool],
        burst: int = 1,
    ) -> None:
        self.server_context, self._limits, self.rejects, self._allowed = (
            server_context,
            limits,
            rejects,
            allowed,
        )
        self.burst = burst
        self.handshakes = HandshakeBudget()
        self.inbound: dict[
            str, dict[int, FrameConnection]
        ] = {}  # authenticated, per identity, oldest first
        self.count = 0  # authenticated connections open
        self.refused: set[str] = (
            set()
        )  # identities refused after their handshake (dropped by the launcher, or slow)
        self.refused_why: dict[
            str, str
        ] = {}  # the reject reason of a refused identity (default: dropped by the launcher)

    async def enter(self, sock: socket.socket, address: Any) -> FrameConnection | None:
        """TLS handshake of an accepted socket (within the budget and its timeout),
        identity, caps: the registered connection, or None when rejected (counted; the
        socket is closed). Raises CancelledError when evicted (the socket is closed)."""
        limits = self._limits()
        loop = asyncio.get_running_loop()
        source = str(address[0]) if isinstance(address, tuple) and address else str(address)
        task = asyncio.current_task()
        assert task is not None
        per_source = max(limits.max_handshakes_per_source, self.burst)
        evicted = self.handshakes.admit(
            task,
            source,
            task.cancel,
            per_source,
            max(limits.max_handshakes, per_source),
            busy=lambda: has_unread(sock),
            now=loop.time(),
            stalled_s=limits.handshake_timeout_s / 4,
        )
        for reason, victim in evicted:
            self.rejects.reject(reason, victim, "closing the oldest silent or stalled connection")
        if (
            task not in self.handshakes
        ):  # every pending one is a handshake under way: the newcomer waits its turn
            sock.close()
            return None
        writer: asyncio.StreamWriter | None = None
        handed = False  # from here on a TLS transport owns the socket (and closes it on failure)
        try:
            async with asyncio.timeout(
                limits.handshake_timeout_s
            ):  # the SSL layer's own timer is only a backstop
                await wait_readable(
                    sock
                )  # silent until here: the first to go when the budget is full
                self.handshakes.advance(task, loop.time())
                handed = True
                reader, writer = await tls_accept(
                    sock,
                    self.server_context,
                    limits.handshake_timeout_s + 1,
                    on_done=lambda: self.handshakes.release(task),
                )
        except TimeoutError:
            self.rejects.reject(
                "TLS handshake timeout",
                str(address),
                f"not done within {limits.handshake_timeout_s} s",
            )
            return None
        except (*NETWORK_ERRORS, ValueError) as exc:
            self.rejects.reject(
                "TLS handshake (no valid certificate of this run)", str(address), repr(exc)
            )
            return None
        finally:
            self.handshakes.release(task)
            if not handed:
                sock.close()
        name = identity(writer)
        problem = None
        if name is None or not self._allowed(name):
            problem = (
                "unknown identity",
                str(address),
                f"certificate name {name!r} is not in the peers file",
            )
        elif name in self.refused:
            problem = (
                self.refused_why.get(name, "dropped by the launcher"),
                name,
                f"connection from {address} refused",
            )
        elif self.count >= limits.max_connections:
            problem = ("connection limit", name, f"{self.count} authenticated connections open")
        if problem is not None:
            self.rejects.reject(*problem)
            writer.transport.abort()
            return None
        assert name is not None
        same = self.inbound.setdefault(name, {})
        live = [c for c in same.values() if not c.closed]
        for old in live[: max(len(live) - limits.max_connections_per_identity + 1, 0)]:
            self.rejects.reject(
                "connections per identity",
                name,
                f"over {limits.max_connections_per_identity}: oldest closed",
            )
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

    def refuse(self, name: str, why: str = "dropped by the launcher") -> bool:
        """Refuse `name` from now on (rejections counted as `why`) and close its
        connections; False if it already was."""
        if name in self.refused:
            return False
        self.refused.add(name)
        self.refused_why[name] = why
        for connection in list(self.inbound.get(name, {}).values()):
            connection.abort()
        return True


class HandshakeBudget:
    """Pending TLS handshakes, at most `per_source` per source address and `total` in all.

    An entry is *silent* until `advance` (its first bytes arrived), then a handshake in
    progress; `release` ends it (done, failed, evicted). `admit` registers a newcomer;
    beyond either bound it first evicts, by calling the `evict` callback the victim was
    registered with, the oldest silent entry of that source (for the total: of all),
    else the oldest handshake stalled for `stalled_s`, never one whose `busy()` says it
    has unread bytes (its client is sending: in TLS 1.3 a client whose last flight is
    in flight already counts the handshake complete). When nothing may be evicted the
    newcomer is not registered (`key in budget` is False). Not thread-safe: loop only."""

    def __init__(self) -> None:
        self._pending: dict[object, _Pending] = {}  # insertion order = age
        self._per_source: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pending

    def admit(
        self,
        key: object,
        source: str,
        evict: Callable[[], object],
        per_source: int,
        total: int,
        busy: Callable[[], bool] = lambda: False,
        now: float = 0.0,
        stalled_s: float = math.inf,
    ) -> list[tuple[str, str]]:
        """Register the handshake `key` from `source`, within `per_source` of its source and
        `total` in all; returns (reason, source) of each entry evicted to make room, and of
        the newcomer itself when it was refused."""
        evicted: list[tuple[str, str]] = []
        for scope, bound, reason in (
            (source, per_source, "handshake evicted (per-source budget full)"),
            (None, total, "handshake evicted (handshake budget full)"),
        ):
            while (self._per_source[source] if scope is not None else len(self._pending)) >= bound:
                victim = self._victim(scope, now, stalled_s)
                if victim is None:
                    return [*evicted, ("handshake refused (every pending one under way)", source)]
                evicted.append((reason, self._evict(victim)))
        self._pending[key] = _Pending(source, evict, busy)
        self._per_source[source] += 1
        return evicted

    def advance(self, key: object, now: float) -> None:
        """The first bytes of `key` arrived: from now on it is a handshake in progress."""
        entry = self._pending.get(key)
        if entry is not None and entry.since is None:
            entry.since = now

    def release(self, key: object) -> None:
        """The handshake `key` finished (or failed, or was evicted): free its slot."""
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._forget(entry.source)

    def _victim(self, source: str | None, now: float, stalled_s: float) -> object | None:
        """The oldest silent entry (of `source`, or of all), else the oldest stalled one; none busy."""
        scope = [(k, e) for k, e in self._pending.items() if source is None or e.source == source]
        for eligible in (
            lambda e: e.since is None,
            lambda e: e.since is not None and now - e.since >= stalled_s,
        ):
            for key, entry in scope:
                if eligible(entry) and not entry.busy():
                    return key
        return None

    def _evict(self, key: object) -> str:
        entry = self._pending.pop(key)
        self._forget(entry.source)
        entry.evict()
        return entry.source

    def _forget(self, source: str) -> None:
        self._per_source[source] -= 1
        if self._per_source[source] <= 0:
            del self._per_source[source]


@dataclass
class _Pending:
    source: str
    evict: Callable[[], object]
    busy: Callable[[], bool]
    since: float | None = None  # loop time its first bytes arrived (None: silent so far)


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

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
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
