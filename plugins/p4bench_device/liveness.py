"""Slow and late peers: when a receiving peer stops waiting for a sender (`SlowPeers`).

Each exchange a receiver waits for the end marker of every sender it expects. Without a
policy, a peer that withholds its end marker, trickles its frames, or simply waits until
just before the exchange timeout and then sends fast, makes every exchange last that long,
for the rest of the run. So each receiver judges every expected sender once per exchange:
the exchange was *slow or late* for it when

- its batch was not complete by its **deadline**, measured from the start of the
  exchange as this receiver sees it (`exchange_deadline_s`): ``max(late_peer_grace_s +
  its bytes / slow_peer_rate_bytes_s, late_peer_factor * M)``, M the completion time
  of the *upper median* sender of the exchange (the ``n // 2``-th of the n judged senders
  in order of completion, known once a strict majority is complete). Honest compute
  skew (a FedAvg server's exchange starts while its clients still train) moves M; a
  minority cannot move it beyond the honest senders' times. The receiver stops waiting
  for a sender at its deadline (`deadline_at`), and at the exchange timeout at the
  latest (no majority complete: no deadline). With one or two senders there is no
  majority to compare with: only the timeout judges them;
- its end marker had not arrived when the exchange closed, or this peer had cut its
  connection for misbehaving (a slow frame, broken framing, an oversized frame; it is not
  waited for until it reconnects);
- it sent more messages than the exchange allows it (`Method.messages_per_pair`: the
  extras are rejected before they are buffered, ``extra message from <id>``), or
- its batch, from its first frame to its end marker, took longer than
  ``slow_peer_grace_s + bytes / slow_peer_rate_bytes_s`` (0: no rate check).

A sender slow or late in `slow_peer_exchanges` (2) of the last `slow_peer_window` (K, 6)
exchanges in which it was expected is dropped by this receiver: refused for the rest of
the run (its connections closed, new ones refused, nothing sent to it, never waited for
again), and announced: in the peer's transport figures (``slow_dropped``), in its round
report, and from there (`drop_reports`: a drop is published as fact once a majority of the
other peers report it) in the run's round metrics and device summary
(``device.slow_dropped``: "dropped slow peer 3"). A sender that left (closed every
connection) or that the launcher dropped is not judged: that is the launcher's drop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from p4bench_device.drop_reports import announced, drop_metrics  # re-exported: defined here before
from p4bench_device.protocol import Limits

log = logging.getLogger("p4bench.device")

__all__ = [
    "SlowPeers",
    "Arrival",
    "SLOW_DROP_REASON",
    "announced",
    "drop_metrics",
    "majority_median",
    "exchange_deadline_s",
]

SLOW_DROP_REASON = (
    "dropped as a slow peer"  # the reject reason of its frames and connections afterwards
)


@dataclass(frozen=True)
class Arrival:
    """How one sender's batch of one exchange arrived at this receiver."""

    complete: bool  # its end marker arrived before the exchange closed
    wire_bytes: int = 0  # frame headers and bodies of the batch
    seconds: float = 0.0  # from its first frame's header to its end marker (loop clock)
    cut: str | None = (
        None  # this peer cut the sender's connection for misbehaving (why), not reconnected since
    )
    finished_s: float | None = (
        None  # its end marker, in seconds from the exchange's start here (0: before it)
    )
    deadline_s: float | None = (
        None  # its deadline from the exchange's start (None: no majority complete)
    )
    extra: int = 0  # its messages rejected beyond the exchange's per-pair limit


def majority_median(finished: Iterable[float | None]) -> float | None:
    """The completion time of the upper median sender: the ``n // 2``-th (from 0) of the n
    judged senders' completion times (None: not complete) in order, None while a strict
    majority is not complete. Fewer than half of the senders can only move it within the
    honest senders' times."""
    times = list(finished)
    done = sorted(t for t in times if t is not None)
    rank = len(times) // 2
    return done[rank] if len(done) > rank else None


def exchange_deadline_s(wire_bytes: int, median_s: float | None, limits: Limits) -> float | None:
    """A sender's deadline in seconds from the exchange's start (module docstring), None
    without a majority's median: then only the exchange timeout bounds the wait."""
    if median_s is None:
        return None
    rate = limits.slow_peer_rate_bytes_s
    floor = limits.late_peer_grace_s + (wire_bytes / rate if rate > 0 else 0.0)
    return max(floor, limits.late_peer_factor * median_s)


class SlowPeers:
    """The drop policy of one receiving peer (see the module docstring). Used on the
    transport's loop only; `reset` at the start of every run."""

    def __init__(self) -> None:
        self.history: dict[str, deque[bool]] = {}  # per sender: slow or late, its last K exchanges
        self.dropped: list[dict[str, Any]] = []  # one entry per sender dropped in this run

    def reset(self) -> None:
        self.history.clear()
        self.dropped.clear()

    @staticmethod
    def slow(arrival: Arrival, limits: Limits) -> str | None:
        """Why this arrival was slow or late (None: on time)."""
        if arrival.cut is not None:
            return f"connection cut ({arrival.cut})"
        if arrival.extra:
            return f"{arrival.extra} extra message(s) beyond the exchange's limit"
        deadline = arrival.deadline_s
        if not arrival.complete:
            if deadline is None:
                return "no end marker at the exchange timeout"
            return f"no end marker by its deadline, {deadline:.1f} s from the exchange's start"
        if (
            deadline is not None
            and arrival.finished_s is not None
            and arrival.finished_s > deadline
        ):
            return f"complete {arrival.finished_s:.1f} s after the exchange's start, past its deadline {deadline:.1f} s"
        rate = limits.slow_peer_rate_bytes_s
        if rate > 0 and arrival.seconds > limits.slow_peer_grace_s + arrival.wire_bytes / rate:
            return (
                f"{arrival.wire_bytes} bytes in {arrival.seconds:.1f} s "
                f"(below {rate} B/s after {limits.slow_peer_grace_s:g} s)"
            )
        return None

    def judge(
        self, arrivals: dict[str, Arrival], limits: Limits, where: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Count this exchange for every expected sender in `arrivals`; returns the senders to
        drop now (slow or late in `slow_peer_exchanges` of their last `slow_peer_window`
        exchanges): {"peer", **where, "reason"} each."""
        drop: list[dict[str, Any]] = []
        window = max(limits.slow_peer_window, 1)
        for peer, arrival in sorted(arrivals.items()):
            why = self.slow(arrival, limits)
            history = self.history.get(peer)
            if history is None or history.maxlen != window:
                history = self.history[peer] = deque(history or (), maxlen=window)
            history.append(why is not None)
            if why is None:
                continue
            count = sum(history)
            log.warning(
                "exchange %s: peer %s slow or late (%s), %d of its last %d exchange(s) (drop at %d)",
                where.get("seq"),
                peer,
                why,
                count,
                len(history),
                limits.slow_peer_exchanges,
            )
            if count >= limits.slow_peer_exchanges:
                del self.history[peer]
                reason = f"slow or late in {count} of its last {len(history)} exchange(s), the last: {why}"
                self.dropped.append({"peer": peer, **where, "reason": reason})
                log.warning("dropped slow peer %s: %s", peer, reason)
                drop.append(dict(self.dropped[-1]))
        return drop
