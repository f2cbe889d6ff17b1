"""The launcher's own privacy figures, and its check of what the peers report.

A peer is a separate party: its reports are claims, not evidence. The launcher therefore
never feeds a peer's DP releases to the run's ledger. It charges the ledger itself, from
the schedule it drives and the mechanism settings it knows: for every round it drives, the
releases the method's `privacy_plan()` makes in that round, for every client, at the run's
calibrated noise multiplier, each step admitted by the run's own budget check
(`job.release_allowed`) and recorded through `job.report_release`. These are the calls the
simulator's DP mechanism makes, so the same ledger and accountants give the same epsilon
for an honest run; the published epsilon is this figure, never a sum of peer reports.

Rounds are charged in schedule order. A phase's planned steps S are spread over its T
rounds as ceil(S r / T) after r rounds, so a run cut short (time budget) is charged for the
rounds it took. Where clients are sampled (client_rate < 1) the launcher cannot see which
clients a round selected (a peer's secret draw), so it charges every client for every round
(K steps each): an upper bound, as rdp/prv/pld take no amplification from client sampling.

Each peer's release reports are then checked against these figures. A release that names
a client the peer does not hold (the peers file says which), a phase or sampling rate the
plan does not declare, a noise multiplier or clip other than the launcher's, or more steps
for the peer's client than the launcher charged, is a mismatch: it names the peer
(``release mismatch from peer <id>: <what>``) and makes the run uncertified
(`p4bench_device.run_finished`). So is a peer that ran a phase the plan declares DP
steps in for every client, and reported no release there (it trained without the DP
mechanism), and a report the launcher rejected on arrival (`report_schema`: its releases
cannot be checked). Reporting fewer steps than charged is not a mismatch: the figure is a bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from p4bench.engine.driver import schedule
from p4bench.engine.job import Job
from p4bench.engine.method import PlannedRelease
from p4bench.records import Release
from p4bench_device.peers import PeersFile
from p4bench_device.report_schema import MalformedRelease, ReleaseClaim

__all__ = ["ReleaseCheck", "mismatch_reasons", "SELF_REPORTED", "MAX_MISMATCHES"]

# What the launcher takes from the peers' reports without being able to check it.
SELF_REPORTED = ("accuracy", "train_loss", "client_bytes", "method_metrics", "measurements")
MAX_MISMATCHES = (
    100  # distinct findings kept (a compromised peer must not grow the summary without bound)
)
MAX_REASONS = 10  # findings named in the certificate's reasons


class ReleaseCheck:
    """Charges the run's ledger with the launcher's own releases and checks the peers'
    release reports against them.

    `job` is the launcher's (its `dp` settings, budget check and ledger relay set by the
    runner); `peers` says which client each peer holds.
    """

    def __init__(self, job: Job, peers: PeersFile) -> None:
        self.job, self.settings = job, job.dp
        self.count = job.data.num_clients
        self.owner = {spec.node: spec.id for spec in peers.peers if spec.node >= 0}
        self.held = {spec.id: spec.node for spec in peers.peers}
        plan = job.method.privacy_plan() if self.settings is not None else []
        self.plan = [entry for entry in plan if entry.steps > 0]
        self.rates: dict[str, list[float]] = {}
        for entry in self.plan:
            self.rates.setdefault(entry.phase, []).append(float(entry.sample_rate))
        self.blocks = [
            (b.phase.name, b.phase.rounds, b.round)
            for b in schedule(job.method)
            if b.kind == "round"
        ]
        self.charged_steps = 0  # rounds charged so far, in schedule order
        self.charged: dict[str, np.ndarray] = {}  # phase -> (M,) steps charged per client
        self.reported: dict[
            str, dict[str, int]
        ] = {}  # peer -> phase -> steps reported for its own client
        self.ran: dict[str, set[str]] = {}  # peer -> phases it reported a round of
        self.findings: dict[tuple[str, str], int] = {}  # (peer, what) -> occurrences
        self.dropped_findings = 0

    # -- the launcher's figures ----------------------------------------------------------
    def charge_through(self, step: int) -> None:
        """Charge every round of the schedule up to `step` (1-based, in schedule order)
        not charged yet: the launcher drove it (or a peer reported it)."""
        while self.charged_steps < min(step, len(self.blocks)):
            phase, rounds, index = self.blocks[self.charged_steps]
            self.charged_steps += 1
            for entry in self.plan:
                if entry.phase == phase:
                    self._charge(phase, entry, rounds, index)

    def _charge(self, phase: str, entry: PlannedRelease, rounds: int, index: int) -> None:
        assert self.settings is not None  # a plan exists only for private runs
        total = (
            int(entry.steps) if float(entry.client_rate) >= 1.0 else int(entry.local_steps) * rounds
        )
        due = -(-total * (index + 1) // rounds) - -(
            -total * index // rounds
        )  # ceil(S r / T) increments
        clients = torch.arange(self.count)
        counts = self.charged.setdefault(phase, np.zeros(self.count, dtype=np.int64))
        rate, sigma = float(entry.sample_rate), float(self.settings.noise_multiplier)
        for _ in range(
            due
        ):  # one step at a time, as the mechanism asks: the budget decides per step
            admitted = clients[self.job.release_allowed(clients, rate, phase).cpu()]
            if len(admitted):
                self.job.report_release(Release(tuple(admitted.tolist()), rate, sigma, 1, phase))
                counts[admitted.numpy()] += 1

    # -- the peers' claims ---------------------------------------------------------------
    def check(
        self, peer: str, kind: str, phase: str, releases: Sequence[ReleaseClaim | MalformedRelease]
    ) -> None:
        """Check the DP releases `peer` reported for one block (`kind` "round" or "setup") of `phase`."""
        if kind == "round":
            self.ran.setdefault(peer, set()).add(phase)
        for claim in releases:
            if isinstance(claim, MalformedRelease):
                self._mismatch(peer, "malformed release entry")
            else:
                self._check_one(peer, claim)

    def rejected(self, peer: str, what: str) -> None:
        """A report of `peer` was rejected on arrival (`report_schema`): whatever releases it
        held cannot be checked, so it counts as a mismatch."""
        self._mismatch(peer, f"report rejected ({what[:300]})")

    def _check_one(self, peer: str, claim: ReleaseClaim) -> None:
        clients, rate, sigma, steps, phase, clip = (
            list(claim.clients),
            claim.sample_rate,
            claim.noise_multiplier,
            claim.steps,
            claim.phase,
            claim.clip,
        )
        node = self.held.get(peer)
        holds = (
            f"it holds client {node}" if node is not None and node >= 0 else "it holds no client"
        )
        others = [c for c in clients if c != node and c in self.owner]
        if others:
            holders = ", ".join(sorted({self.owner[c] for c in others}))
            self._mismatch(
                peer, f"release for client(s) {_ids(others)} of peer(s) {holders} ({holds})"
            )
        unknown = [c for c in clients if c != node and c not in self.owner]
        if unknown:
            self._mismatch(
                peer, f"release for client(s) {_ids(unknown)}, which no peer holds ({holds})"
            )
        if self.settings is None:
            self._mismatch(peer, "DP release reported in a non-private run")
            return
        if phase not in self.rates:
            self._mismatch(
                peer, f"release in phase '{phase}', which privacy_plan() does not declare"
            )
        elif not any(math.isclose(rate, r, rel_tol=1e-9) for r in self.rates[phase]):
            declared = ", ".join(f"{r:g}" for r in sorted(self.rates[phase]))
            self._mismatch(
                peer, f"sampling rate {rate:g} in phase '{phase}'; the plan declares {declared}"
            )
        if not math.isclose(sigma, self.settings.noise_multiplier, rel_tol=1e-9):
            self._mismatch(
                peer,
                f"noise multiplier {sigma:g}; the launcher's is {self.settings.noise_multiplier:g}",
            )
        if clip is None or not math.isclose(clip, self.settings.clip, rel_tol=1e-9):
            self._mismatch(peer, f"clip {clip!r}; the launcher's is {self.settings.clip:g}")
        if (
            node is not None and node in clients and phase in self.rates
        ):  # (an undeclared phase: found above)
            phases = self.reported.setdefault(peer, {})
            phases[phase] = phases.get(phase, 0) + steps

    def _mismatch(self, peer: str, what: str) -> None:
        key = (peer, what)
        if key in self.findings or len(self.findings) < MAX_MISMATCHES:
            self.findings[key] = self.findings.get(key, 0) + 1
        else:
            self.dropped_findings += 1

    # -- the end of the run ----------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """The end-of-run checks (counts beyond the launcher's figures, DP phases without a
        release), then the summary's ``device.releases``."""
        everyone = {entry.phase for entry in self.plan if float(entry.client_rate) >= 1.0}
        for peer, node in sorted(self.held.items()):
            if node < 0:
                continue
            reported = self.reported.get(peer, {})
            for phase, steps in sorted(reported.items()):
                allowed = int(self.charged[phase][node]) if phase in self.charged else 0
                if steps > allowed:
                    self._mismatch(
                        peer,
                        f"{steps} release step(s) of client {node} in phase '{phase}'; the launcher's "
                        f"plan for the rounds it drove allows {allowed}",
                    )
            for phase in sorted(everyone & self.ran.get(peer, set())):
                charged = int(self.charged[phase][node]) if phase in self.charged else 0
                if charged and not reported.get(phase):
                    self._mismatch(
                        peer,
                        f"no DP release of client {node} reported in phase '{phase}', where the plan "
                        f"declares {charged} step(s) for the rounds it ran",
                    )
        return {
            "epsilon_from": "launcher: privacy_plan() over the rounds it drove"
            if self.settings is not None
            else None,
            "charged": {phase: int(steps.max(initial=0)) for phase, steps in self.charged.items()},
            "reported": {peer: dict(phases) for peer, phases in sorted(self.reported.items())},
            "mismatches": [
                {"peer": peer, "what": what, "count": n}
                for (peer, what), n in self.findings.items()
            ],
            "mismatches_not_kept": self.dropped_findings,
        }


def mismatch_reasons(releases: dict[str, Any] | None) -> list[str]:
    """The certificate's reasons for a run's ``device.releases`` (empty: none found)."""
    found: Sequence[dict[str, Any]] = (releases or {}).get("mismatches") or []
    reasons = [f"release mismatch from peer {m['peer']}: {m['what']}" for m in found[:MAX_REASONS]]
    more = len(found) - len(reasons) + int((releases or {}).get("mismatches_not_kept") or 0)
    if more > 0:
        reasons.append(f"release mismatches: {more} more (summary device.releases)")
    return reasons


def _ids(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:20])
    return shown + (f", ... ({len(values)} in all)" if len(values) > 20 else "")
