"""The `device` runtime: the launcher side of a run across peer processes.

The launcher connects to every peer (TLS, as ``launcher``), sends the run's config and
seed (public: shared streams such as the partition derive from it, each peer's private
draws do not), says go, and then only listens: each peer reports every round (its client's
accuracy, losses, bytes, measurements, DP releases) and finally its state. From those
reports the launcher builds the same `RoundReport`s and `Outcome` as the simulator, so
the runner logs the run to MLflow like any other. The DP releases are the exception: the
launcher charges the ledger with its own figures and checks the peers' release reports
against them (`report_check`); accuracies and measurements are self-reported
(``device.self_reported``): beside the mean the launcher publishes their median and names
the peers whose accuracy stands out (`accuracy_check`). With ``--local-peers N`` it first
starts N peers (and a server peer for server-based methods) on 127.0.0.1 with a fresh
CA in a temporary folder.

A peer whose connection closes before its final report is dropped: the run goes on
with the others, its last reported accuracy stands, and the drop is recorded in the
summary (``device.dropped``) and in the round metrics (``device.peers_alive``).

What arrives from the peers, and how a round's reports are gathered and booked, is the
launcher's base `PeerReports` (`launcher_reports`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load as st_load

from p4bench.engine.method import Phase
from p4bench.engine.runtime import Job, RoundReport
from p4bench.engine.schedule import TimeBudget, budget_rule, schedule, stop_reason
from p4bench.engine.state import State, unflatten
from p4bench_device.accuracy_check import accuracy_check, accuracy_metrics
from p4bench_device.launcher_link import LauncherLink
from p4bench_device.launcher_reports import PeerReports
from p4bench_device.local import LocalPeers, free_ports  # noqa: F401  (re-exported)
from p4bench_device.outcome import DeviceError, DeviceOutcome  # re-exported: defined here before
from p4bench_device.peers import PeersFile
from p4bench_device.protocol import Limits
from p4bench_device.report_check import SELF_REPORTED, ReleaseCheck
from p4bench_device.report_fields import (  # noqa: F401 - critical_compute_s re-exported
    critical_compute_s,
    deployed_from_states,
    finish_summary,
    round_metrics,
)
from p4bench_device.report_schema import ReportContext

log = logging.getLogger("p4bench.device")

__all__ = ["DeviceOutcome", "DeviceError", "LocalPeers", "Launcher"]


class Launcher(PeerReports):
    """Starts a run on the peers of `peers` and collects their reports."""

    def __init__(
        self,
        peers: PeersFile,
        tls_dir: str | Path,
        limits: Limits,
        check: Callable[[], None] = lambda: None,
        local: bool = False,
        on_connected: Callable[[], None] = lambda: None,
        link: str | None = None,
        profile: str | None = None,
    ) -> None:
        super().__init__(peers, limits)
        self.tls_dir, self.check, self.local = tls_dir, check, local
        self.on_connected = (
            on_connected  # every peer listens (has loaded its keys) and the launcher is connected
        )
        self.link_spec, self.profile = (
            link,
            profile,
        )  # the link every peer shapes its traffic to; the local peers' profile
        self.finish: dict[
            str, Any
        ] = {}  # the time budget's stop: when it was decided, after which step

    def link_profile(self) -> dict[str, Any] | None:
        """The shaped link's capacity, recorded next to the measured transfer times."""
        from p4bench_device.link import parse_link

        return parse_link(self.link_spec).to_dict() if self.link_spec else None

    # -- the run ------------------------------------------------------------------------
    def run(self, job: Job, on_round: Callable[[RoundReport], None]) -> DeviceOutcome:
        self.job = job
        self.context = ReportContext(
            self.peers, frozenset((b.kind, b.phase.name, b.round) for b in schedule(job.method))
        )
        self.figures = ReleaseCheck(
            job, self.peers
        )  # the run's epsilon: from the schedule driven here
        self.link = LauncherLink(self.peers, self.tls_dir, self.limits)
        try:
            # until go, a connection that closes is opened again before it counts as a drop (a flood may end it)
            self.link.reconnect_within(self.limits.startup_timeout_s)
            try:
                self.link.connect_all(self.limits.startup_timeout_s, self.check)
            except ConnectionError as exc:
                raise DeviceError(f"cannot reach the peers: {exc}") from None
            self.link.reconnect_within(
                self.limits.startup_timeout_s
            )  # and while the peers get ready
            self.on_connected()
            log.info("connected to %d peers; sending the config", len(self.peers.peers))
            self.start_message = start = {
                "type": "start",
                "run_id": f"{job.config.config_hash()}-{uuid.uuid4().hex[:12]}",
                "config": job.config.to_dict(),
                "peers": self.peers.to_dict(),
                "limits": self.limits.to_dict(),
                "link": self.link_spec,
            }
            for spec in self.peers.peers:
                self.link.send(spec.id, start)
            everyone = {p.id for p in self.peers.peers}
            ready = self._wait(
                lambda: self.ready | set(self.errors) | self.closed >= everyone,
                self.limits.startup_timeout_s,
            )
            if self.errors or not ready or self.closed:
                missing = sorted(everyone - self.ready)
                detail = (
                    "; ".join(f"{p}: {m}" for p, m in sorted(self.errors.items()))
                    or f"not ready: {', '.join(missing)}"
                )
                raise DeviceError(f"the run could not start on every peer ({detail})")
            log.info("all %d peers ready; go", len(everyone))
            self.link.reconnect_within(None)
            for spec in self.peers.peers:
                self.link.send(spec.id, {"type": "go"})
            outcome = self._collect(job, self._announcing(on_round))
            # drops a majority of the other peers report are facts; one peer's word is a claim
            outcome.device["slow_dropped"], outcome.device["slow_drops_unconfirmed"] = (
                self.slow_drops()
            )
            outcome.device["reconnects"] = dict(
                self.link.reconnects
            )  # start-up reconnections per peer
            return outcome
        finally:
            self.finishing = True
            for spec in self.peers.peers:
                if spec.id not in self.closed:
                    self.link.send(spec.id, {"type": "stop"})
            self.link.close()

    def _collect(self, job: Job, on_round: Callable[[RoundReport], None]) -> DeviceOutcome:
        count = job.data.num_clients
        self.accuracy = np.full(count, np.nan)
        self.extra: dict[str, np.ndarray] = {}
        self.totals: dict[str, dict[str, dict[str, Any]]] = {p.id: {} for p in self.peers.peers}
        reports: list[RoundReport] = []
        total_bytes = 0
        # The launcher owns the time budget's clock (from `go`); the peers stop when it says.
        budget = budget_rule(job.config.time_budget_min)
        self.steps = {
            (b.phase.name, b.round): i
            for i, b in enumerate((b for b in schedule(job.method) if b.kind == "round"), 1)
        }
        finish_after: int | None = None
        for block in schedule(job.method):  # the peers' drivers walk the same blocks
            if block.kind == "setup":
                total_bytes += sum(
                    r.bytes_sent for r in self._gather("setup", block.phase, -1).values()
                )
                continue
            report = self._round_report(block.phase, block.round, len(reports) + 1)
            total_bytes += report.bytes_sent
            reports.append(report)
            self.figures.charge_through(
                report.step
            )  # before on_round: the ledger's round figures include it
            on_round(report)
            if not self.active:
                raise DeviceError(f"every peer dropped out ({self.dropped})")
            # the engine's one rule: the time budget, or the method's own on every client's values (P4L's mrt/mrr)
            if (
                finish_after is None
                and stop_reason(report.step, report.extra_accuracy, budget, job.method) is not None
            ):
                finish_after = self._send_finish(report.step)
            if finish_after is not None and report.step >= finish_after:
                break
        self.where = ("final", -1)
        self._wait(lambda: self.active <= set(self.finals), self.limits.round_timeout_s)
        self.finishing = True
        log.info("collected %d final reports", len(self.finals))
        self._account_overrun()
        outcome = self._outcome(job, reports, total_bytes)
        outcome.budget_overran_at = budget.overran_at if isinstance(budget, TimeBudget) else None
        return outcome

    def _send_finish(self, step: int) -> int | None:
        """The time budget ran out (or the method's stop rule held) after round `step`: tell every peer to stop after
        step s = h + 2, where h >= `step` is the highest step any peer has reported by now (its
        pending reports read first). The peers read control messages after each round, so
        a peer that has reported h stops after s as long as the message reaches it before
        it finishes step h + 2: the margin lets one whole round pass while the message is
        on its way (and the launcher is still logging round `step`). Peers that exchange
        every round run in lockstep, at most a round apart, and the slower ones have more
        margin; peers of a method with rounds without exchanges (local training) run
        unsynchronised, and the margin covers each of them the same way, since h is the
        fastest peer's step. A round shorter than the message's delay could still outrun
        it: then a peer stops after the step it is in, its extra rounds' DP releases are
        still accounted (`_account_overrun`), and `device.finish.consistent` is false.
        None when s would be the last step anyway."""
        while self._pump(0.0):
            pass
        reported = [
            self.steps.get((phase, index), 0)
            for kind, phase, index in self.reports
            if kind == "round"
        ]
        highest = max([step, *reported])
        after = highest + 2
        if after >= len(self.steps):
            return None
        self.finish = {
            "decided_after_step": step,
            "highest_reported_step": highest,
            "after_step": after,
            "margin": 2,
        }
        log.info(
            "stop decided after step %d (time budget or the method's rule): the peers stop after step %d",
            step,
            after,
        )
        for peer in sorted(self.active):
            self.link.send(peer, {"type": "finish", "after_step": after})
        return after

    def _account_overrun(self) -> None:
        """Rounds that peers ran past the finish step (a margin that was too short): not in
        any round report, but their DP releases were taken all the same (charged, checked)."""
        ran = [
            self.steps.get((phase, index), 0)
            for kind, phase, index in self.reports
            if kind == "round"
        ]
        self.figures.charge_through(max(ran, default=0))
        for (_kind, phase, _index), got in sorted(self.reports.items()):
            for peer, report in sorted(got.items()):
                if peer in self.totals:
                    self._account(peer, phase, report)
        self.reports.clear()

    def _store_extra(self, node: int, extra: Mapping[str, float | None]) -> None:
        """A peer's extra accuracies into the run's per-client arrays (None: not finite on the peer)."""
        for name, value in extra.items():
            self.extra.setdefault(name, np.full(self.job.data.num_clients, np.nan))[node] = (
                np.nan if value is None else value
            )

    def _round_report(self, phase: Phase, round_index: int, step: int) -> RoundReport:
        got = self._gather("round", phase, round_index)
        count = self.job.data.num_clients
        sent, received = np.zeros(count, np.int64), np.zeros(count, np.int64)
        losses = [x for report in got.values() for x in report.losses if x is not None]
        for peer, report in got.items():
            node = self.peers.by_id[peer].node
            if node >= 0:
                if report.accuracy is not None:
                    self.accuracy[node] = report.accuracy
                self._store_extra(node, report.extra)
                sent[node] = report.node_bytes_sent
                received[node] = report.node_bytes_received
        metrics = {
            "device.peers_alive": float(len(self.active)),
            "device.peers_reported": float(len(got)),
            **round_metrics(got),
            **accuracy_metrics(self._accuracy_check()),
        }
        return RoundReport(
            phase=phase.name,
            round=round_index,
            step=step,
            accuracy=self.accuracy.copy(),
            train_loss=float(np.mean(losses)) if losses else float("nan"),
            seconds=max(
                [0.0, *(r.measure.wall_s for r in got.values())]
            ),  # steps only, evaluation excluded
            bytes_sent=sum(r.bytes_sent for r in got.values()),
            metrics=metrics,
            client_bytes_sent=sent,
            client_bytes_received=received,
            extra_accuracy={k: v.copy() for k, v in self.extra.items()},
        )

    def _accuracy_check(self) -> dict[str, Any]:
        """The peers' self-reported accuracies so far, robustly (`accuracy_check`)."""
        malicious = self.job.malicious
        return accuracy_check(
            self.accuracy,
            {p.id: p.node for p in self.peers.peers},
            None if malicious is None else [bool(x) for x in malicious.tolist()],
        )

    def _outcome(self, job: Job, reports: list[RoundReport], total_bytes: int) -> DeviceOutcome:
        count, method = job.data.num_clients, job.method
        states: dict[int, State] = {}
        peers: dict[str, Any] = {}
        for spec in self.peers.peers:
            final, blob = self.finals.get(spec.id, (None, None))
            if final is not None and spec.node >= 0 and final.accuracy is not None:
                self.accuracy[spec.node] = final.accuracy
                self._store_extra(spec.node, final.extra)
            if blob is not None and spec.node >= 0:
                try:
                    states[spec.node] = unflatten(
                        st_load(blob), sep="/"
                    )  # parameter names contain dots
                except Exception as exc:  # noqa: BLE001 - a bad state only loses that peer's artifacts
                    self.link.rejects.reject("malformed state", spec.id, repr(exc))
            peers[spec.id] = {
                "node": spec.node,
                "host": spec.host,
                "phases": self.totals.get(spec.id, {}),
                "finished": final is not None,
                "receive_errors": final.receive_errors if final else None,
                "transport": final.transport if final else None,
                "error": self.errors.get(spec.id),
                "profile": final.profile if final else None,
                "link": final.link if final else None,
            }
        params, final_state = deployed_from_states(method, states, count)
        for outlier in self._accuracy_check().get("outliers", []):
            log.warning("%s", outlier["message"])
        device = {
            "local_peers": self.local,
            "peers": peers,
            "dropped": self.dropped,
            "absences": self.absences,
            "launcher_rejected": self.link.rejects.snapshot(),
            "limits": self.limits.to_dict(),
            "link": self.link_profile(),
            "profile": self.profile,
            "releases": self.figures.finish(),
            "self_reported": list(SELF_REPORTED),
            "accuracy_check": self._accuracy_check(),
            "rejected_reports": self.rejected_reports,
        }
        if self.finish:
            device["finish"] = finish_summary(
                self.finish, {p: final.stopped_after_step for p, (final, _) in self.finals.items()}
            )
        return DeviceOutcome(
            self.accuracy.copy(),
            {k: v.copy() for k, v in self.extra.items()},
            reports,
            params,
            total_bytes,
            final_state,
            device=device,
            peer_states=states,
        )
