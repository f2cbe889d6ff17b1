"""The per-client privacy ledger: observes every noisy release and answers epsilon.

Methods report releases (sampling rate, noise multiplier, steps) through the
`privacy_release` hook; the ledger keeps each client's history and evaluates it with
any accountant. It also enforces the budget: a client whose next step would exceed the
target epsilon under the run's accountant stops releasing.

Every run reports epsilon under its own accountant, under `rdp` (the long-standing
cross-check) and under `pld` (tight for both relations).

The headline figures are those of the reported clients. The evaluation clients (the
`eval_fraction` reserved for tuning) train in the run too, through the same mechanism,
so their epsilon is reported on its own (`epsilon_evaluation_clients`: the largest
among them in this run, under the run's accountant); the ledger learns who they are
from the run (`run_started`).

Neighbouring relations (:func:`accounted_epsilon`): `pld` analyses add-remove (std
sigma*C) and replace-one (std 2*sigma*C) natively. `rdp` and `prv` analyse
add/remove-one neighbours; under replace-one they analyse multiplier 2*sigma for
add/remove and convert soundly by group privacy: a replacement is a removal then an
addition, so (eps, delta) for add/remove gives (2 eps, delta (1 + e^eps)) for
replacement. The `noble` bound is a replacement analysis with sensitivity 2C, so its
multiplier is std / (2C).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from p4bench.hookspecs import hookimpl
from p4bench.privacy.accountants import Accountant, ReleaseSegment, accounted_epsilon
from p4bench.privacy.mechanism import DPSettings
from p4bench.records import Release, RoundReport, RunInfo

__all__ = ["PrivacyLedger", "accounted_epsilon"]  # accounted_epsilon: re-exported from accountants


class PrivacyLedger:
    """Observer plugin holding every client's release history.

    `accountant` answers the budget and the headline epsilon; `reference` (rdp) and
    `pld` are reported next to it (`epsilon_rdp*`, `epsilon_pld*`; `pld` None skips it).
    `context` describes the run for bounds that need it (noble: local steps K, client
    rate l, clients M, view). Steps are kept per (phase, sample rate, sigma) key.
    """

    def __init__(
        self,
        settings: DPSettings,
        accountant: Accountant,
        reference: Accountant,
        num_clients: int,
        delta: float,
        budget: float | None,
        context: dict[str, Any],
        pld: Accountant | None = None,
    ) -> None:
        self.settings, self.accountant, self.reference, self.pld = (
            settings,
            accountant,
            reference,
            pld,
        )
        self.num_clients, self.delta, self.budget = num_clients, delta, budget
        self.context = context
        self.keys: list[tuple[str, float, float]] = []
        self.steps: dict[tuple[str, float, float], np.ndarray] = {}
        self.rounds: dict[str, int] = {}
        self.stopped = np.zeros(num_clients, dtype=bool)
        self.stop_log: list[tuple[str, int, list[int]]] = []
        self._cache: dict[tuple[str, tuple[int, ...]], float] = {}
        self._max_steps: dict[
            tuple[tuple[str, float, float], tuple[tuple[object, int], ...]], int
        ] = {}
        self._current_phase = ""
        self._current_round = -1
        self.evaluation: np.ndarray | None = (
            None  # (M,) bool: the evaluation clients, once the run says
        )

    # -- histories ------------------------------------------------------------------
    def _segment(self, key: tuple[str, float, float], steps: int) -> ReleaseSegment:
        phase, rate, sigma = key
        local_steps = int(self.context.get("local_steps", {}).get(phase, 1) or 1)
        rounds = max(self.rounds.get(phase, 0), math.ceil(steps / local_steps))
        return ReleaseSegment(
            noise_multiplier=sigma,
            sample_rate=rate,
            steps=int(steps),
            local_steps=local_steps,
            rounds=rounds,
            client_rate=float(self.context.get("client_rate", {}).get(phase, 1.0)),
            clients=int(self.context.get("clients", self.num_clients)),
            view=str(self.context.get("view", "third-party")),
        )

    def history(
        self, client: int, extra: tuple[tuple[str, float, float], int] | None = None
    ) -> list[ReleaseSegment]:
        counts = {key: int(self.steps[key][client]) for key in self.keys}
        if extra is not None:
            counts[extra[0]] = counts.get(extra[0], 0) + extra[1]
        return [self._segment(key, n) for key, n in counts.items() if n > 0]

    def _uses_rounds(self, accountant: Accountant) -> bool:
        """Whether the bound depends on elapsed rounds, not only on steps taken (noble)."""
        return bool(getattr(accountant, "uses_rounds", accountant.name == "noble"))

    def _signature(self, client: int, accountant: Accountant) -> tuple[int, ...]:
        steps = tuple(int(self.steps[key][client]) for key in self.keys)
        if self._uses_rounds(accountant):
            return steps + tuple(self.rounds.get(k[0], 0) for k in self.keys)
        return steps

    def _epsilon(
        self, accountant: Accountant, history: list[ReleaseSegment], signature: tuple[int, ...]
    ) -> float:
        cache_key = (accountant.name, signature)
        if cache_key not in self._cache:
            self._cache[cache_key] = accounted_epsilon(
                accountant, history, self.delta, self.settings.neighbouring
            )
        return self._cache[cache_key]

    def epsilons(self, accountant: Accountant | None = None) -> np.ndarray:
        """(M,) epsilon of every client's history so far."""
        accountant = accountant or self.accountant
        return np.array(
            [
                self._epsilon(accountant, self.history(c), self._signature(c, accountant))
                for c in range(self.num_clients)
            ]
        )

    # -- budget -----------------------------------------------------------------------
    def allowed(self, clients: torch.Tensor, sample_rate: float, phase: str) -> torch.Tensor:
        """(len(clients),) bool: who can afford one more step at `sample_rate` in `phase`."""
        if self.budget is None:
            return torch.ones(len(clients), dtype=torch.bool, device=clients.device)
        ids = (
            clients.cpu().numpy().astype(np.int64)
        )  # bookkeeping on the host (one read per release)
        self._current_phase = phase
        key = (phase, float(sample_rate), float(self.settings.noise_multiplier))
        done = self.steps[key][ids] if key in self.steps else np.zeros(len(ids), dtype=np.int64)
        # Clients with the same history elsewhere share one budget answer: look it up once per distinct history.
        others = [k for k in self.keys if k != key]
        histories = (
            np.stack([self.steps[k][ids] for k in others], axis=1)
            if others
            else np.zeros((len(ids), 0), np.int64)
        )
        distinct, inverse = np.unique(histories, axis=0, return_inverse=True)
        affordable = np.array(
            [
                self._affordable(int(ids[np.flatnonzero(inverse.reshape(-1) == i)[0]]), key)
                for i in range(len(distinct))
            ]
        )
        ok = (done + 1 <= affordable[inverse.reshape(-1)]) & ~self.stopped[ids]
        newly = ids[~ok & ~self.stopped[ids]]
        if len(newly):
            self.stopped[newly] = True
            self.stop_log.append((self._current_phase, self._current_round, newly.tolist()))
        return torch.from_numpy(ok).to(clients.device)

    def _affordable(self, client: int, key: tuple[str, float, float]) -> int:
        """Largest step count under `key` that keeps the client within budget."""
        budget = self.budget
        assert budget is not None  # `allowed` asks only when there is a budget
        others: tuple[tuple[object, int], ...] = tuple(
            (k, int(self.steps[k][client])) for k in self.keys if k != key
        )
        if self._uses_rounds(self.accountant):
            others += tuple(sorted(self.rounds.items()))
        cache_key = (key, others)
        if cache_key in self._max_steps:
            return self._max_steps[cache_key]

        def fits(n: int) -> bool:
            counts = {k: int(self.steps[k][client]) for k in self.keys if k != key}
            counts[key] = n
            history = [self._segment(k, c) for k, c in counts.items() if c > 0]
            return (
                accounted_epsilon(self.accountant, history, self.delta, self.settings.neighbouring)
                <= budget
            )

        low, high = 0, 1
        while fits(high) and high < 10_000_000:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        self._max_steps[cache_key] = low
        return low

    # -- hooks -------------------------------------------------------------------------
    @hookimpl
    def run_started(self, run: RunInfo) -> None:
        self.evaluation = np.asarray(run.evaluation, dtype=bool)

    @hookimpl
    def privacy_release(self, run: RunInfo, release: Release) -> None:
        self.record_release(release)

    def record_release(self, release: Release) -> None:
        """Count one release of the clients it names (what the hook does; a device peer,
        which runs no hooks, calls it for its own releases)."""
        key = (release.phase, float(release.sample_rate), float(release.noise_multiplier))
        if key not in self.steps:
            self.keys.append(key)
            self.steps[key] = np.zeros(self.num_clients, dtype=np.int64)
        np.add.at(self.steps[key], np.array(release.clients, dtype=np.int64), release.steps)

    @hookimpl(tryfirst=True)
    def round_finished(self, run: RunInfo, report: RoundReport) -> None:
        report.metrics.update(self.end_round(report.phase, report.round, run.reported))

    def end_round(self, phase: str, round_index: int, reported: np.ndarray) -> dict[str, float]:
        """Count a finished round of `phase` (some accountants' budgets depend on the rounds
        elapsed); the round's epsilon figures over the `reported` clients."""
        self.rounds[phase] = self.rounds.get(phase, 0) + 1
        self._current_round = round_index + 1
        metrics: dict[str, float] = {}
        for label, accountant in self._reported_accountants():
            values = self.epsilons(accountant)[reported] if reported.any() else np.zeros(1)
            metrics[f"{label}_max"] = float(values.max())
            metrics[f"{label}_mean"] = float(values.mean())
        metrics["clients_stopped"] = float(self.stopped.sum())
        return metrics

    def _reported_accountants(self) -> list[tuple[str, Accountant]]:
        pairs = [("epsilon", self.accountant), ("epsilon_rdp", self.reference)]
        return pairs + ([("epsilon_pld", self.pld)] if self.pld is not None else [])

    def summary(self, reported: np.ndarray, evaluation: np.ndarray | None = None) -> dict[str, Any]:
        """The run's privacy figures: epsilon (max and mean over the `reported` clients, or
        over every client where none is reported) under each accountant, the evaluation
        clients' own epsilon (`evaluation`, else those of the run's `run_started`), the
        settings and the budget stops."""
        mask = reported if reported.any() else np.ones_like(reported)
        figures: dict[str, Any] = {}
        for label, accountant in self._reported_accountants():
            values = self.epsilons(accountant)[mask]
            figures[label], figures[f"{label}_mean"] = float(values.max()), float(values.mean())
        return {
            **figures,
            **self.evaluation_figures(evaluation),
            "epsilon_budget": self.budget,
            "accountant": self.accountant.name,
            "delta": self.delta,
            "noise_multiplier": self.settings.noise_multiplier,
            "clip": self.settings.clip,
            "neighbouring": self.settings.neighbouring,
            "clients_stopped": int(self.stopped.sum()),
            "budget_stops": [{"phase": p, "round": r, "clients": c} for p, r, c in self.stop_log],
        }

    def evaluation_figures(self, evaluation: np.ndarray | None = None) -> dict[str, Any]:
        """`epsilon_evaluation_clients`: the largest epsilon among the evaluation clients in
        this run under the run's accountant (None where there are none, or the ledger was
        never told who they are), and `evaluation_clients`, how many there are (where
        known). They are counted apart from the reported clients' headline epsilon."""
        chosen = self.evaluation if evaluation is None else np.asarray(evaluation, dtype=bool)
        if chosen is None or chosen.shape != (self.num_clients,):
            return {"epsilon_evaluation_clients": None}
        values = self.epsilons()[chosen]
        return {
            "epsilon_evaluation_clients": float(values.max()) if len(values) else None,
            "evaluation_clients": int(chosen.sum()),
        }
