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
A sender is waited for up to its deadline from the exchange's start; one slow or late in
several recent exchanges, or sending more messages than the exchange allows, is dropped
by this peer (`liveness`).

Hardening (see `Limits`): connections are accepted raw (`listener`) and, until
authenticated, get a small handshake budget that evicts its oldest silent or stalled
entry when full, never a completed handshake (`admission`); authenticated ones are capped
in total and per identity, closed when idle (the launcher pings) or when a frame body
trickles in (a sender cut so is not waited for until it reconnects); data is only
buffered during a run (`begin_run` .. `end_run`), within caps that scale with the run's
model size (`set_model_bytes`); a peer the launcher dropped is refused (`refuse`).

What reaches this peer (admission, frame reading, buffered batches) is `inbound.Inbound`;
the connections it opens to send are `outbound.Outbound`. The launcher's side of the
connections is `launcher_link.LauncherLink` (re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import zlib
from collections import Counter
from dataclasses import dataclass, field
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
from p4bench_device.inbound import EPOCH_SHIFT, MARKER_FIELDS, Inbound, Received
from p4bench_device.launcher_link import EVENT_RECONNECTED, LauncherLink, parse_report
from p4bench_device.link import LinkShaper
from p4bench_device.listener import Listener
from p4bench_device.liveness import SLOW_DROP_REASON, SlowPeers
from p4bench_device.outbound import Outbound
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import (
    KIND_END,
    KIND_MESSAGE,
    KIND_REPORT,
    KIND_STATE,
    Limits,
    dump_json,
)
from p4bench_device.signing_keys import load_signing_key
from p4bench_device.tls import client_context, server_context

log = logging.getLogger("p4bench.device")

__all__ = [
    "PeerTransport",
    "LauncherLink",
    "FrameConnection",
    "ExchangeResult",
    "RejectLog",
    "LoopThread",
    "open_frames",
    "parse_report",
    "EVENT_RECONNECTED",
    "EPOCH_SHIFT",
    "MARKER_FIELDS",
]


@dataclass
class ExchangeResult:
    """What one exchange brought (`PeerTransport.exchange`)."""

    received: dict[str, tuple[dict[str, Any], list[Received]]]  # sender -> (marker, messages)
    absent: set[str]  # expected senders whose batch did not complete
    unreachable: set[str]  # destinations that could not be sent to
    wire_bytes_sent: int = 0
    dropped: list[dict[str, Any]] = field(
        default_factory=list
    )  # senders dropped as slow at this exchange (`liveness`)


class PeerTransport:
    """The network side of one peer (see the module docstring).

    Per run, the node calls `begin_run` (before any peer can send), `set_model_bytes` once
    the run's model is built, and `end_run` when the run is over; `shaper` (an object with
    ``async pace(nbytes)``, or None) shapes what this peer sends to peers and the launcher."""

    def __init__(self, me: PeerSpec, peers: PeersFile, tls_dir: str | Path, limits: Limits) -> None:
        self.me, self.peers, self.limits = me, peers, limits
        self.server_context = server_context(tls_dir, me.id)
        self.signing_key = load_signing_key(tls_dir, me.id)  # signs digests (equivocation check)
        self.client_context = client_context(tls_dir, me.id)
        self.rejects = RejectLog()
        self.control: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stats: Counter[str] = Counter()
        self.shaper: LinkShaper | None = None  # the node also reads its figures
        # used on the loop thread only:
        self.inbound = Inbound(
            me,
            peers,
            self.server_context,
            lambda: self.limits,
            lambda: self.shaper,
            self.rejects,
            self.stats,
            self.control,
            on_refuse=self._stop_sending,
        )
        self.outbound = Outbound(
            peers,
            self.client_context,
            lambda: self.limits,
            lambda: self.shaper,
            self.rejects,
            self.stats,
        )
        self._slow = SlowPeers()  # the drop policy for slow senders (`liveness`)
        self._unreachable: set[str] = set()
        self._late_sends: set[asyncio.Task[int | None]] = set()  # delayed batches (`late-sender`)
        self._before_run: dict[str, int] = {}  # rejections between the last run and this one
        self._counts_at_end: dict[str, int] = {}
        self._server: Listener | None = None
        self._thread = LoopThread(f"p4bench-device-{me.id}")

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        return self._thread.call(self._start(host, port), timeout=30)

    async def _start(self, host: str, port: int) -> int:
        self._server = Listener(host, port, self.inbound.accept)
        return self._server.port

    def close(self) -> None:
        def close_all() -> None:
            if self._server is not None:
                self._server.close()
            self.outbound.close()
            if self.inbound.launcher is not None:
                self.inbound.launcher.close()

        close_on_loop(self._thread, close_all)

    def begin_run(self, run_id: str = "") -> None:
        """A new run starts: forget every buffered frame, connection history, refusal,
        rejection count and statistic of the last one, and accept data frames again.
        Exchange numbers on the wire carry the run's epoch (from its id) in their top 24 bits."""

        async def reset() -> None:
            self.inbound.reset((zlib.crc32(run_id.encode()) & 0xFFFFFF) << EPOCH_SHIFT)
            self._unreachable.clear()
            self._slow.reset()
            self.stats.clear()
            counts = Counter(self.rejects.reset())
            counts.subtract(
                self._counts_at_end
            )  # the last run's own counts were in its final report
            self._before_run, self._counts_at_end = {k: v for k, v in counts.items() if v > 0}, {}
            if self._before_run:
                log.warning("rejected between runs: %s", self._before_run)

        self._thread.call(reset(), timeout=10)

    def end_run(self) -> None:
        """The run is over: drop every buffered batch; until the next `begin_run`, data
        frames are refused unread beyond a few KiB ("no run active")."""

        async def end() -> None:
            self.inbound.run_active = False
            self.inbound.drop_buffers()
            for task in list(self._late_sends):  # a delayed batch of this run never leaves after it
                task.cancel()
            self._counts_at_end = self.rejects.snapshot()

        self._thread.call(end(), timeout=10)

    def set_model_bytes(self, nbytes: int) -> None:
        """The run's model size in bytes: the buffering caps scale with it (`Limits.buffer_caps`)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"model bytes must be an integer >= 0, got {nbytes!r}")

        async def store() -> None:
            self.inbound.model_bytes = nbytes

        self._thread.call(store(), timeout=10)

    def buffer_caps(self) -> tuple[int, int]:
        """(per-sender, total) bytes of messages this peer buffers now."""
        return self.inbound.buffer_caps()

    def refuse(self, peer_id: str) -> None:
        """Refuse `peer_id` for the rest of this run (the launcher dropped it): its
        connections are closed, new ones refused, its buffered frames dropped, and
        exchanges no longer wait for it or send to it. ValueError for an unknown peer."""
        self._thread.call(self.inbound.refuse(peer_id), timeout=10)

    def _stop_sending(self, peer: str) -> None:
        self.outbound.abort(peer)

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
            return {
                **self.stats,
                "rejected": self.rejects.snapshot(),
                "refused": sorted(self.inbound.gate.refused),
                "slow_dropped": [dict(entry) for entry in self._slow.dropped],
                **extra,
            }

        return self._thread.call(read(), timeout=10)

    # -- exchanges ------------------------------------------------------------------------
    def exchange(
        self,
        seq: int,
        outgoing: dict[str, list[bytes]],
        marker: dict[str, Any],
        expected: set[str],
        targets: set[str],
        per_pair: dict[str, int] | None = None,
        send_delay_s: float = 0.0,
    ) -> ExchangeResult:
        """Send `outgoing[dst]` frames plus an end marker to every target, and wait for
        the complete batch of every expected sender (or its absence). `per_pair[sender]`:
        the most messages a sender may send this peer in the exchange (extras are rejected
        before they are buffered); `send_delay_s` > 0 (the `late-sender` attack only):
        the frames leave that long after the exchange starts, without holding it up."""
        limit = self.limits.exchange_timeout_s + (self.limits.retries + 2) * (
            self.limits.send_timeout_s + self.limits.connect_timeout_s
        )
        return self._thread.call(
            self._exchange(seq, outgoing, marker, expected, targets, per_pair, send_delay_s),
            timeout=limit + 30,
        )

    async def _exchange(
        self,
        seq: int,
        outgoing: dict[str, list[bytes]],
        marker: dict[str, Any],
        expected: set[str],
        targets: set[str],
        per_pair: dict[str, int] | None = None,
        send_delay_s: float = 0.0,
    ) -> ExchangeResult:
        loop, inbound = asyncio.get_running_loop(), self.inbound
        inbound.start_exchange(seq, per_pair)
        deadline = loop.time() + self.limits.exchange_timeout_s
        refused = (
            targets & inbound.gate.refused
        )  # dropped (by the launcher, or as slow): nothing goes to them any more
        sends = {
            dst: asyncio.create_task(
                self._send_batch(dst, seq, outgoing.get(dst, []), marker, send_delay_s)
            )
            for dst in sorted(targets - self._unreachable - refused)
        }
        if send_delay_s > 0:  # sent later, not waited for: the late sender itself goes on at once
            self._late_sends |= set(sends.values())
            for task in sends.values():
                task.add_done_callback(self._late_sends.discard)
            sends = {}
        for dst in sorted(set(outgoing) - set(sends)):
            if outgoing[dst]:
                why = inbound.gate.refused_why.get(dst, "unreachable this round")
                log.warning(
                    "exchange %s: %d message(s) for %s not sent: %s",
                    marker.get("exchange"),
                    len(outgoing[dst]),
                    dst,
                    why,
                )
        await inbound.await_markers(seq, expected, deadline)
        sent = {dst: await task for dst, task in sends.items()}
        batches = inbound.take(seq)
        received = {
            s: (b.marker, b.messages)
            for s, b in batches.items()
            if s in expected and b.marker is not None
        }
        inbound.closed_seq = seq
        dropped = self._slow.judge(
            inbound.arrivals(expected, batches),
            self.limits,
            {"seq": seq, **{k: marker.get(k) for k in ("phase", "round", "exchange")}},
        )
        for entry in dropped:
            await inbound.refuse(entry["peer"], SLOW_DROP_REASON)
        unreachable = {dst for dst, nbytes in sent.items() if nbytes is None} | refused
        self._unreachable |= unreachable
        return ExchangeResult(
            received,
            set(expected) - set(received),
            unreachable,
            sum(n for n in sent.values() if n),
            dropped,
        )

    async def _send_batch(
        self, dst: str, seq: int, frames: list[bytes], marker: dict[str, Any], delay_s: float = 0.0
    ) -> int | None:
        """Bytes written, or None when every attempt failed (bounded retries, backoff)."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        wire = self.inbound.epoch | seq
        payload = [(KIND_MESSAGE, wire, f) for f in frames] + [
            (KIND_END, wire, dump_json({**marker, "count": len(frames)}))
        ]
        attempts = (
            1 if self.inbound.gone(dst) else 1 + self.limits.retries
        )  # a peer seen leaving gets one try per round
        return await self.outbound.send(dst, payload, attempts, f"exchange {seq}")

    # -- reports to the launcher -----------------------------------------------------
    def report(self, message: dict[str, Any], state: bytes | None = None) -> bool:
        """Send a report (and optionally a state blob first) to the launcher; every report
        carries this peer's id (``peer``: the launcher checks it is the sender's)."""
        try:
            return self._thread.call(
                self._report(message, state), timeout=self.limits.send_timeout_s + 10
            )
        except Exception as exc:  # noqa: BLE001
            log.warning("report %s not delivered: %r", message.get("type"), exc)
            return False

    def report_later(self, message: dict[str, Any]) -> None:
        """Queue a report without waiting for it to be written, so that a round's report
        does not hold up the next round. Reports leave in the order they were queued (the
        connection's lock is first come, first served); failures are logged."""
        asyncio.run_coroutine_threadsafe(self._report(message, None), self._thread.loop)

    async def _report(self, message: dict[str, Any], state: bytes | None) -> bool:
        connection = self.inbound.launcher
        if connection is None or connection.closed:
            log.warning(
                "report %s not delivered: the launcher is not connected", message.get("type")
            )
            return False
        body = dump_json({**message, "peer": self.me.id})
        frames = ([(KIND_STATE, 0, state)] if state is not None else []) + [(KIND_REPORT, 0, body)]
        try:
            written = await connection.send(frames, self.limits.send_timeout_s, self.shaper)
        except NETWORK_ERRORS as exc:
            log.warning("report %s not delivered: %r", message.get("type"), exc)
            return False
        self.stats["wire_bytes_sent_launcher"] += written
        return True
