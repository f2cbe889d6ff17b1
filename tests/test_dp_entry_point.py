"""Every noisy step goes through one DP entry point, `Releases`: no noise is drawn
outside a release the ledger recorded, on P4's generic, bucketed and span paths alike,
and the audit still observes every release (or names the calls it cannot observe)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from p4bench import hookimpl
from p4bench.audit import AuditedMechanism, CanaryBank, run_audit
from p4bench.privacy.mechanism import DPMechanism, DPSettings
from p4bench.privacy.noise import NoiseStreams
from p4bench.privacy.releases import Releases, current_releases
from p4bench.run.runner import run


class LedgerSpy:
    """Observer: every release the ledger is told about."""

    def __init__(self) -> None:
        self.releases = []

    @hookimpl
    def privacy_release(self, run, release):
        self.releases.append(release)

    def per_client(self) -> Counter:
        return Counter(c for r in self.releases for c in r.clients for _ in range(r.steps))


@pytest.fixture
def draws(monkeypatch):
    """Fails any noise draw outside an open release of the same clients; logs every
    transaction as (rows, admitted (K, C), steps, drawn)."""
    log = SimpleNamespace(fills=0, transactions=[])
    fill, leave = NoiseStreams.fill, Releases.__exit__

    def checked_fill(self, parts):
        releases = current_releases()
        assert releases is not None, "DP noise drawn outside a recorded release"
        assert self.node_ids == releases.ctx.rows.tolist(), (
            "noise of clients the open release does not cover"
        )
        log.fills += 1
        return fill(self, parts)

    def logged_exit(self, kind, value, traceback):
        log.transactions.append(
            (self.ctx.rows.tolist(), self.admitted.clone(), self.steps, self.drawn)
        )
        return leave(self, kind, value, traceback)

    monkeypatch.setattr(NoiseStreams, "fill", checked_fill)
    monkeypatch.setattr(Releases, "__exit__", logged_exit)
    return log


PATHS = {
    "generic": {"fused": False},
    "buckets": {"fused": "buckets"},
    "span-basis": {"fused": "span", "span_noise": "basis"},
    "span-streams": {"fused": "span", "span_noise": "streams"},
}


@pytest.mark.parametrize("budget", [False, True], ids=["calibrated", "budget-stops"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_noise_draw_is_inside_a_recorded_release(small_config, draws, path, budget):
    # budget-stops: fixed noise that the rdp bound runs out of during co-training
    stops = {
        "epsilon": 12.0,
        "noise_multiplier": 0.8,
        "accountant": "rdp",
        "local_steps": 4,
        "data_rate": 0.6,
    }
    privacy = stops if budget else {"epsilon": 8.0}
    config = small_config(method="p4", clients=6, rounds=2, options=PATHS[path], **privacy)
    spy = LedgerSpy()
    result = run(config, observers=[spy], track=False)
    assert draws.fills > 0 and draws.transactions and spy.releases
    admitted = Counter()
    for rows, granted, steps, drawn in draws.transactions:
        assert drawn == steps  # each recorded release got its noise, no more
        for row, count in zip(rows, granted.sum(dim=0).tolist()):
            admitted[row] += count
    assert (
        +admitted == spy.per_client()
    )  # the ledger saw exactly the releases the transactions admitted
    if budget:  # the refusals really happened, on every path
        assert {stop["phase"] for stop in result.summary["budget_stops"]} == {"cotraining"}


def test_a_path_that_skips_the_entry_point_is_caught(draws):
    """What the fast paths did by hand before: noise straight from the mechanism, no release open."""
    rows = [0, 1]
    mechanism = DPMechanism(
        DPSettings(clip=1.0, noise_multiplier=1.0),
        NoiseStreams(0, rows),
        lambda r: None,
        lambda clients, rate, phase: torch.ones(len(clients), dtype=torch.bool),
    )
    with pytest.raises(AssertionError, match="outside a recorded release"):
        mechanism.add_scaled_noise({"bias": torch.zeros(2, 3)}, None)


def test_the_transaction_refuses_unrecorded_or_missing_noise():
    recorded = []
    mechanism = DPMechanism(
        DPSettings(clip=1.0, noise_multiplier=1.0),
        NoiseStreams(0, [0, 1]),
        recorded.append,
        lambda clients, rate, phase: clients != 1,
    )  # client 1's budget is spent
    ctx = SimpleNamespace(rows=torch.tensor([0, 1]), phase="train")
    target = {"bias": torch.zeros(2, 3)}
    releases = Releases(mechanism, ctx, 0.5, steps=2)
    with pytest.raises(RuntimeError, match="inside its open release"):
        releases.add_scaled_noise(target, None)  # not entered: nothing recorded yet
    assert recorded == []
    with pytest.raises(RuntimeError, match="2 release\\(s\\) recorded, noise drawn for 1"):
        with releases:
            assert releases.admitted.tolist() == [[True, False], [True, False]]
            assert [r.clients for r in recorded] == [(0,), (0,)]  # recorded on entry
            releases.add_scaled_noise(target, None)
    with pytest.raises(RuntimeError, match="noise for 3 releases, only 2 recorded"):
        with Releases(mechanism, ctx, 0.5, steps=2) as more:
            more.draw([torch.empty(2, 3), torch.empty(2, 3)])
            more.add_scaled_noise(target, None)


def test_the_audit_sees_every_release_of_p4(small_config):
    """The audit runs P4 on its generic path, where every release carries canaries."""
    result = run_audit(small_config(method="p4", clients=6, rounds=2, epsilon=4.0), track=False)
    assert (
        result.bound.trials > 0 and not result.exceeds
    )  # raises IncompatibleError on an unobserved release
    assert "fused=false" in result.notes[0]


@pytest.mark.parametrize(
    "options, calls",
    [
        ({"fused": False}, []),
        ({"fused": "buckets"}, ["add_scaled_noise"]),
        ({"fused": "span"}, ["draw_noise"]),
    ],
)
def test_a_wrapped_mechanism_sees_or_names_every_noisy_call(small_config, options, calls):
    """Under `wrap_mechanism`, fused releases reach the wrapper's noise methods (the audit
    names them instead of missing them); generic ones go through its `release`."""
    config = small_config(method="p4", clients=6, rounds=2, epsilon=8.0, options=options)
    bank, spy = CanaryBank(6, 4, seed=1), LedgerSpy()

    def prepared(run):
        run.job.wrap_mechanism = lambda mechanism: AuditedMechanism(mechanism, bank)

    run(config, observers=[spy], track=False, on_prepared=prepared)
    assert bank.bypassed == calls
    observed = bank.releases.tolist()
    if not calls:
        assert observed == [spy.per_client()[c] for c in range(6)] and sum(observed) > 0
