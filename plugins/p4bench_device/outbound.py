"""The sending side of a peer's transport (`Outbound`): the connections this peer opens to
the other peers, and the delivery of one exchange's frames to one of them.

Peers never answer on a data connection: what a peer receives comes in on the connections
the others open to it (`inbound`). A connection idle for half the receivers' idle timeout
is replaced before use (the receiver closes it at the full timeout, and frames written as
it does would be lost). Runs on the transport's loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from collections.abc import Callable

from p4bench_device.admission import NETWORK_ERRORS, FrameConnection, RejectLog, Shaper, open_frames
from p4bench_device.peers import PeersFile
from p4bench_device.protocol import Limits

log = logging.getLogger("p4bench.device")

__all__ = ["Outbound", "Frames"]

Frames = list[tuple[int, int, bytes]]  # (kind, wire seq, body) of each frame


class Outbound:
    """This peer's connections to the other peers (see the module docstring). `limits` and
    `shaper` are read at every use (a run's replace the defaults)."""

    def __init__(
        self,
        peers: PeersFile,
        client_context: ssl.SSLContext,
        limits: Callable[[], Limits],
        shaper: Callable[[], Shaper | None],
        rejects: RejectLog,
        stats: Counter[str],
    ) -> None:
        self.peers, self.client_context, self._limits, self._shaper = (
            peers,
            client_context,
            limits,
            shaper,
        )
        self.rejects, self.stats = rejects, stats
        self.connections: dict[str, FrameConnection] = {}

    async def send(self, dst: str, frames: Frames, attempts: int, what: str) -> int | None:
        """Write `frames` to `dst`: bytes written, or None when each of `attempts` failed
        (exponential backoff between them). `what` names the frames in the warning."""
        limits = self._limits()
        failure: BaseException | None = None
        for attempt in range(attempts):
            try:
                connection = await self._connection(dst)
                written = await connection.send(frames, limits.send_timeout_s, self._shaper())
                self.stats["wire_bytes_sent"] += written
                self.stats["frames_sent"] += len(frames)
                return written
            except NETWORK_ERRORS as exc:
                failure = exc
                stale = self.connections.pop(dst, None)
                if stale is not None:
                    stale.close()
                if attempt + 1 < attempts:
                    await asyncio.sleep(limits.backoff_s * 2**attempt)
        log.warning("could not send %s to %s after %d attempt(s): %r", what, dst, attempts, failure)
        return None

    def abort(self, dst: str) -> None:
        """Close the connection to `dst` at once (it was refused)."""
        connection = self.connections.pop(dst, None)
        if connection is not None:
            connection.abort()

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()

    async def _connection(self, dst: str) -> FrameConnection:
        loop = asyncio.get_running_loop()
        limits = self._limits()
        connection = self.connections.get(dst)
        if connection is not None and not connection.closed:
            if loop.time() - connection.last_sent < limits.idle_timeout_s / 2:
                return connection
            # The receiver closes a connection idle for idle_timeout_s; frames written as it does would be
            # lost, so take a fresh one well before. The old one is left for the receiver to close: closing it
            # here could make the receiver, still waiting for this batch, think this peer left.
            loop.call_later(limits.idle_timeout_s, connection.close)
        spec = self.peers.by_id[dst]
        connection = await open_frames(spec.host, spec.port, self.client_context, dst, limits)
        self.connections[dst] = connection
        loop.create_task(self._watch(connection))
        return connection

    async def _watch(self, connection: FrameConnection) -> None:
        """Peers never answer on a data connection: anything read is rejected, EOF closes it."""
        try:
            while await connection.reader.read(65536):
                self.rejects.reject("data on an outbound connection", connection.name)
        except NETWORK_ERRORS:
            pass
        finally:
            connection.close()
