"""The launcher's inbox (`PeerReports`, the base of `Launcher`): the events its link
delivers from the peers (reports, state blobs, connections closed or opened again), each
report checked on arrival (`report_schema`; a rejected one is counted and kept with its
reason), the peers dropped (a closed connection, a failure, slow peers that other peers
dropped: `liveness`), and a round's reports gathered once every active peer sent its own
and booked: their DP releases checked (`report_check`), their measurements added to the
phase totals."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from p4bench.engine.method import Phase
from p4bench.engine.runtime import RoundReport
from p4bench.rng import SERVER_ID
from p4bench_device.drop_reports import announced, drop_metrics, split_drops
from p4bench_device.launcher_link import EVENT_RECONNECTED, LauncherLink
from p4bench_device.peers import PeersFile
from p4bench_device.protocol import KIND_STATE, Limits
from p4bench_device.report_check import ReleaseCheck
from p4bench_device.report_fields import add_measure
from p4bench_device.report_schema import (
    BlockReport,
    Failure,
    FinalReport,
    PeerReport,
    Ready,
    ReportContext,
    ReportError,
    parse_report,
)

log = logging.getLogger("p4bench.device")

# rejected reports kept with their reasons (a compromised peer must not grow the summary without bound)
MAX_REJECTED = 100

__all__ = ["MAX_REJECTED", "PeerReports"]


class PeerReports:
    """What the peers of `peers` sent and what became of them. `Launcher.run` opens the
    `link` and sets the run's report `context` and release check (`figures`); `totals`
    (peer -> phase -> measurements) is set when it starts collecting."""

    link: LauncherLink
    context: ReportContext
    figures: ReleaseCheck
    totals: dict[str, dict[str, dict[str, Any]]]

    def __init__(self, peers: PeersFile, limits: Limits) -> None:
        self.peers, self.limits = peers, limits
        self.reports: dict[
            tuple[str, str, int], dict[str, BlockReport]
        ] = {}  # (kind, phase, round) -> peer -> report
        self.finals: dict[str, tuple[FinalReport, bytes | None]] = {}
        self.rejected_reports: list[
            dict[str, str]
        ] = []  # {"peer", "reason"}, the first MAX_REJECTED
        self.pending_state: dict[str, bytes] = {}
        self.ready: set[str] = set()
        self.errors: dict[str, str] = {}
        self.closed: set[str] = set()
        self.dropped: list[dict[str, Any]] = []
        self.absences: list[dict[str, Any]] = []
        self.where = ("start", -1)
        self.finishing = False
        self.start_message: dict[str, Any] | None = (
            None  # sent again to a peer reconnected during start-up
        )
        self.slow_dropped: list[
            dict[str, Any]
        ] = []  # peers that other peers dropped as slow (`liveness`)

    @property
    def active(self) -> set[str]:
        return {p.id for p in self.peers.peers} - self.closed - set(self.errors)

    # -- events -------------------------------------------------------------------------
    def _pump(self, timeout: float) -> bool:
        try:
            peer, kind, body = self.link.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if kind is None:
            self._on_closed(peer)
        elif kind == EVENT_RECONNECTED:
            self._on_reconnected(peer)
        elif kind == KIND_STATE:
            self.pending_state[peer] = body
        else:
            try:
                report = parse_report(body, peer, self.context)
            except ReportError as exc:
                self._on_rejected(exc)
                return True
            self._on_report(report)
        return True

    def _on_rejected(self, error: ReportError) -> None:
        """A report that failed its check on arrival: counted, kept (with its reason) for the
        summary, and a mismatch of the release check (`report_check`)."""
        self.link.rejects.reject("malformed report", error.peer, error.what)
        if len(self.rejected_reports) < MAX_REJECTED:
            self.rejected_reports.append({"peer": error.peer, "reason": error.what})
        self.figures.rejected(error.peer, error.what)

    def _on_report(self, report: PeerReport) -> None:
        peer = report.peer
        if isinstance(report, Ready):
            self.ready.add(peer)
        elif isinstance(report, Failure):
            self.errors[peer] = report.message
            log.error("peer %s failed: %s", peer, report.message)
            if self.ready and peer in self.ready:
                self._drop(peer, f"error: {report.message}")
        elif isinstance(report, BlockReport):
            self.reports.setdefault((report.kind, report.phase, report.round), {})[peer] = report
            self._on_slow_drops(report)
        else:
            self.finals[peer] = (report, self.pending_state.pop(peer, None))

    def _on_slow_drops(self, report: BlockReport) -> None:
        """Record the peers the reporter says it dropped as slow (`liveness`): claims until a
        majority of the other peers backs them (`drop_reports`)."""
        nodes = {p.id: p.node for p in self.peers.peers}
        for entry in announced(report.peer, report.slow_dropped, nodes)[
            : 1000 - len(self.slow_dropped)
        ]:
            self.slow_dropped.append(entry)
            log.warning("peer %s reports: %s", report.peer, entry["message"])

    def slow_drops(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(confirmed, unconfirmed) slow-peer drops reported so far (`drop_reports.split_drops`)."""
        server = frozenset(p.id for p in self.peers.peers if p.node == SERVER_ID)  # believed alone
        return split_drops(self.slow_dropped, self.active, server)

    def _announcing(self, on_round: Callable[[RoundReport], None]) -> Callable[[RoundReport], None]:
        """`on_round` with the slow-peer drops so far in the round's metrics (`drop_reports.drop_metrics`)."""

        def announce(report: RoundReport) -> None:
            report.metrics.update(drop_metrics(*self.slow_drops()))
            on_round(report)

        return announce

    def _on_reconnected(self, peer: str) -> None:
        """Start-up: the peer's connection closed and was opened again. What it may have
        missed is the start message (a peer that has it already answers ready again)."""
        log.info("reconnected to peer %s during start-up", peer)
        if self.start_message is not None and peer not in self.ready:
            self.link.send(peer, self.start_message)

    def _on_closed(self, peer: str) -> None:
        self.closed.add(peer)
        if peer not in self.finals and not self.finishing and peer not in self.errors:
            self._drop(peer, "connection closed")

    def _drop(self, peer: str, reason: str) -> None:
        phase, round_index = self.where
        spec = self.peers.by_id[peer]
        self.dropped.append(
            {
                "peer": peer,
                "node": spec.node,
                "phase": phase,
                "round": round_index,
                "reason": reason,
            }
        )
        log.warning(
            "peer %s (node %d) dropped during %s round %d: %s",
            peer,
            spec.node,
            phase,
            round_index,
            reason,
        )
        for other in sorted(
            self.active - {peer}
        ):  # a dropped peer's key must not keep feeding the others
            self.link.send(other, {"type": "drop", "peer": peer})

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                return False
            self._pump(min(0.5, deadline - time.monotonic()))
        return True

    def _gather(self, kind: str, phase: Phase, round_index: int) -> dict[str, BlockReport]:
        """Every active peer's report of this round (waiting for them), bookkept."""
        self.where = (phase.name, round_index)
        key = (kind, phase.name, round_index)
        done = self._wait(
            lambda: self.active <= set(self.reports.get(key, {})), self.limits.round_timeout_s
        )
        got = self.reports.pop(key, {})
        if not done:
            late = sorted(self.active - set(got))
            log.warning(
                "%s round %d: no report from %s within %.0f s",
                phase.name,
                round_index,
                ", ".join(late),
                self.limits.round_timeout_s,
            )
        for peer, report in sorted(got.items()):
            self._account(peer, phase.name, report)
        return got

    def _account(self, peer: str, phase: str, report: BlockReport) -> None:
        """Check a report's DP releases (never charged: `report_check`) and add its measurements to the phase totals."""
        self.figures.check(peer, report.kind, phase, report.releases)
        for absence in report.absent[: max(1000 - len(self.absences), 0)]:
            self.absences.append(
                {
                    "reporter": peer,
                    "phase": phase,
                    "round": report.round,
                    "exchange": absence.exchange,
                    "peers": list(absence.peers),
                }
            )
        totals = self.totals[peer].setdefault(phase, {"rounds": 0, "exchanges": {}})
        totals["rounds"] += int(report.kind == "round")
        add_measure(totals, report.measure)
