"""Slow peers: when a receiving peer stops waiting for a sender (`SlowPeers`).

Each exchange a receiver waits for the end marker of every sender it expects, up to the
exchange timeout. Without a policy, a peer that withholds its end marker, or trickles
its frames just fast enough not to be cut, makes every exchange last that long, for the
rest of the run. So each receiver judges every expected sender once per exchange: the
exchange was *slow* for it when

- its end marker had not arrived when the exchange closed (at the timeout, or at once
  when this peer had cut its connection for misbehaving: a slow frame, broken framing,
  an oversized frame; it is not waited for until it reconnects), or
- its batch, from its first frame to its end marker, took longer than
  ``slow_peer_grace_s + bytes / slow_peer_rate_bytes_s`` (0: no rate check).

A sender slow in `slow_peer_exchanges` (K) consecutive exchanges in which it was expected
is dropped by this receiver: refused for the rest of the run (its connections closed, new
ones refused, nothing sent to it, never waited for again), and announced: in the peer's
transport figures (``slow_dropped``), in its round report, and from there in the run's
round metrics and device summary (``device.slow_dropped``: "dropped slow peer 3").
An exchange on time resets its count. A sender that left (closed every connection) or
that the launcher dropped is not judged: that is the launcher's drop, not a slow peer.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p4bench_device.protocol import Limits
from p4bench_device.report_schema import SlowDrop

log = logging.getLogger("p4bench.device")

__all__ = ["SlowPeers", "Arrival", "SLOW_DROP_REASON", "announced", "drop_metrics"]

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
        None  # this peer cut the sender's connection for misbehaving (why), and it has not reconnected
    )


class SlowPeers:
    """The drop policy of one receiving peer (see the module docstring). Used on the
    transport's loop only; `reset` at the start of every run."""

    def __init__(self) -> None:
        self.streak: Counter[str] = Counter()  # consecutive slow exchanges per sender
        self.dropped: list[dict[str, Any]] = []  # one entry per sender dropped in this run

    def reset(self) -> None:
        self.streak.clear()
        self.dropped.clear()

    @staticmethod
    def slow(arrival: Arrival, limits: Limits) -> str | None:
        """Why this arrival was slow (None: on time)."""
        if arrival.cut is not None:
            return f"connection cut ({arrival.cut})"
        if not arrival.complete:
            return "no end marker"
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
        drop now (their Kth consecutive slow exchange): {"peer", **where, "reason"} each."""
        drop: list[dict[str, Any]] = []
        for peer, arrival in sorted(arrivals.items()):
            why = self.slow(arrival, limits)
            if why is None:
                self.streak.pop(peer, None)
                continue
            self.streak[peer] += 1
            count = self.streak[peer]
            log.warning(
                "exchange %s: peer %s slow (%s), %d of %d in a row",
                where.get("seq"),
                peer,
                why,
                count,
                limits.slow_peer_exchanges,
            )
            if count >= limits.slow_peer_exchanges:
                del self.streak[peer]
                reason = f"slow in {count} consecutive exchange(s), the last: {why}"
                self.dropped.append({"peer": peer, **where, "reason": reason})
                log.warning("dropped slow peer %s: %s", peer, reason)
                drop.append(dict(self.dropped[-1]))
        return drop


# -- the launcher's side: announcing the drops the peers report ------------------------
def announced(
    reporter: str, drops: Sequence[SlowDrop], nodes: dict[str, int]
) -> list[dict[str, Any]]:
    """The slow-peer drops of `reporter`'s round report (checked on arrival: other peers of
    the peers file, `nodes`: id -> node), worded for the run's record: {"peer", "node",
    "by", "phase", "round", "exchange", "reason", "message"} each."""
    entries = []
    for drop in drops:
        message = (
            f"dropped slow peer {drop.peer} (by peer {reporter} in {drop.phase} round {drop.round}, "
            f"exchange {drop.exchange}: {drop.reason})"
        )
        entries.append(
            {
                "peer": drop.peer,
                "node": nodes[drop.peer],
                "by": reporter,
                "phase": drop.phase,
                "round": drop.round,
                "exchange": drop.exchange,
                "reason": drop.reason,
                "message": message,
            }
        )
    return entries


def drop_metrics(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Round metrics of the drops so far: how many peers were dropped as slow, and by how
    many peers each (``device.<peer>.slow_dropped_by``)."""
    by: dict[str, set[str]] = {}
    for entry in entries:
        by.setdefault(entry["peer"], set()).add(entry["by"])
    return {
        "device.slow_peers_dropped": float(len(by)),
        **{
            f"device.{peer}.slow_dropped_by": float(len(receivers))
            for peer, receivers in sorted(by.items())
        },
    }
