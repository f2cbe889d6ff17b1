"""The launcher's side of the device transport: one TLS connection to every peer,
control messages out, reports in (`LauncherLink`).

During start-up (`reconnect_within`) a connection that closes is opened again, with
bounded retries and backoff, before it counts as the peer's drop: a peer under a
connection flood, say, may end a connection the launcher already counted as open. A
reconnection is reported as an `EVENT_RECONNECTED` event, so that the launcher can
repeat what the peer may have missed (`Launcher` re-sends its start message); once the
run has started (``go``), a closed connection is a drop as before.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p4bench_device.admission import (
    NETWORK_ERRORS,
    FrameConnection,
    LoopThread,
    RejectLog,
    close_on_loop,
    open_frames,
)
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import (
    KIND_CONTROL,
    KIND_REPORT,
    KIND_STATE,
    FrameError,
    Limits,
    RejectedFrame,
    dump_json,
    load_json,
    read_frame,
)
from p4bench_device.tls import LAUNCHER, IdentityError, client_context

log = logging.getLogger("p4bench.device")

# the peers' idle timeout before the launcher's limits reach them: the launcher pings at least this often / 3
_DEFAULT_IDLE_S = Limits().idle_timeout_s
EVENT_RECONNECTED = (
    -1
)  # an event's kind: the peer's connection closed and was opened again (start-up only)
_FIRST_DELAY_S, _MAX_DELAY_S = 0.05, 1.0  # backoff between connection attempts

__all__ = ["LauncherLink", "EVENT_RECONNECTED", "parse_report"]


class LauncherLink:
    """The launcher's connections to every peer: control out, reports in. Once connected
    it pings every peer every third of the idle timeout (peers close silent connections);
    their pongs are not passed on as events. `events` yields (peer, frame kind, body),
    (peer, None, b"") when a peer's connection is closed for good, and (peer,
    EVENT_RECONNECTED, b"") when it was opened again (see the module docstring)."""

    def __init__(self, peers: PeersFile, tls_dir: str | Path, limits: Limits) -> None:
        self.peers, self.limits = peers, limits
        self.context = client_context(tls_dir, LAUNCHER)
        self.events: queue.Queue[tuple[str, int | None, bytes]] = (
            queue.Queue()
        )  # (peer, kind or None at close, body)
        self.rejects = RejectLog()
        self.reconnects: Counter[str] = Counter()  # connections opened again, per peer
        self._connections: dict[str, FrameConnection] = {}
        self._keepalive: asyncio.Task[None] | None = None
        self._check: Callable[[], None] = lambda: None
        self._reconnect_until: float | None = None  # loop time; None: a closed connection is final
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = (
            set()
        )  # reconnections under way (the loop keeps only weak references)
        self._thread = LoopThread("p4bench-device-launcher")

    def connect_all(self, deadline_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Connect to every peer, retrying with backoff until `deadline_s` (peers may
        still be starting). `check` raises to give up early (a local peer exited)."""
        self._check = check
        self._thread.call(self._connect_all(deadline_s, check), timeout=deadline_s + 30)

    def reconnect_within(self, seconds: float | None) -> None:
        """From now on, open a peer's connection again when it closes, until `seconds`
        from now; None: a connection that closes stays closed (the peer's drop)."""

        async def store() -> None:
            self._reconnect_until = (
                None if seconds is None else asyncio.get_running_loop().time() + seconds
            )

        self._thread.call(store(), timeout=10)

    async def _connect_all(self, deadline_s: float, check: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s

        async def one(spec: PeerSpec) -> None:
            self._attach(await self._open(spec, deadline, check))

        await asyncio.gather(*(one(spec) for spec in self.peers.peers))
        if self._keepalive is None:
            self._keepalive = loop.create_task(self._ping_loop())

    async def _open(
        self, spec: PeerSpec, deadline: float, check: Callable[[], None]
    ) -> FrameConnection:
        """A connection to `spec`, retried with backoff until `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        delay = _FIRST_DELAY_S
        while True:
            check()
            try:
                return await open_frames(spec.host, spec.port, self.context, spec.id, self.limits)
            except IdentityError:
                raise
            except NETWORK_ERRORS as exc:
                if loop.time() + delay > deadline:
                    raise ConnectionError(
                        f"peer {spec.id} at {spec.host}:{spec.port} not reachable: {exc!r}"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_DELAY_S)

    def _attach(self, connection: FrameConnection) -> None:
        self._connections[connection.name] = connection
        asyncio.get_running_loop().create_task(self._read(connection))

    async def _ping_loop(self) -> None:
        # a peer that has not received the run's limits yet uses the default idle timeout
        interval = min(self.limits.idle_timeout_s, _DEFAULT_IDLE_S) / 3
        ping = [(KIND_CONTROL, 0, dump_json({"type": "ping"}))]
        while True:
            await asyncio.sleep(interval)
            live = [c for c in self._connections.values() if not c.closed]
            results = await asyncio.gather(
                *(c.send(ping, self.limits.send_timeout_s) for c in live), return_exceptions=True
            )
            for connection, result in zip(live, results):
                if isinstance(result, BaseException):
                    log.debug("ping to %s failed: %r", connection.name, result)

    async def _read(self, connection: FrameConnection) -> None:
        try:
            while True:
                try:
                    kind, seq, body = await read_frame(
                        connection.reader, self.limits.max_message_bytes
                    )
                except RejectedFrame as exc:
                    self.rejects.reject(exc.reason, connection.name, exc.detail)
                    continue
                if kind not in (KIND_REPORT, KIND_STATE):
                    self.rejects.reject(
                        "frame kind not allowed from a peer", connection.name, chr(kind)
                    )
                    continue
                if kind == KIND_REPORT and len(body) < 256 and _is_pong(body):
                    continue  # the answer to a keepalive ping
                self.events.put((connection.name, kind, body))
        except FrameError as exc:
            self.rejects.reject("broken framing", connection.name, str(exc))
        except (*NETWORK_ERRORS, ValueError):
            pass
        finally:
            connection.close()
            until = self._reconnect_until
            if self._connections.get(connection.name) is not connection:
                pass  # an old connection, already replaced
            elif (
                not self._closing
                and until is not None
                and asyncio.get_running_loop().time() < until
            ):
                task = asyncio.get_running_loop().create_task(
                    self._reconnect(connection.name, until)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                self.events.put((connection.name, None, b""))

    async def _reconnect(self, peer: str, deadline: float) -> None:
        log.warning("connection to peer %s closed during start-up; connecting again", peer)
        try:
            connection = await self._open(self.peers.by_id[peer], deadline, self._check)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - unreachable, wrong identity, or a local peer exited
            log.warning("peer %s not reachable again: %r", peer, exc)
            self.events.put((peer, None, b""))
            return
        if self._closing:
            connection.close()
            self.events.put((peer, None, b""))
            return
        self.reconnects[peer] += 1
        self._attach(connection)
        self.events.put((peer, EVENT_RECONNECTED, b""))

    def send(self, peer: str, message: dict[str, Any]) -> bool:
        connection = self._connections.get(peer)
        if connection is None or connection.closed:
            return False

        async def write() -> bool:
            try:
                await connection.send(
                    [(KIND_CONTROL, 0, dump_json(message))], self.limits.send_timeout_s
                )
                return True
            except NETWORK_ERRORS as exc:
                log.warning("control %s to %s failed: %r", message.get("type"), peer, exc)
                return False

        try:
            return self._thread.call(write(), timeout=self.limits.send_timeout_s + 10)
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        def close_all() -> None:
            self._closing = True
            if self._keepalive is not None:
                self._keepalive.cancel()
            for connection in self._connections.values():
                connection.close()

        close_on_loop(self._thread, close_all)


def _is_pong(body: bytes) -> bool:
    try:
        kind: str = parse_report(body)["type"]  # a string: parse_report checks it
        return kind == "pong"
    except RejectedFrame:
        return False


def parse_report(body: bytes) -> dict[str, Any]:
    """A peer's JSON report (RejectedFrame if malformed)."""
    return load_json(body, {"type": str})
