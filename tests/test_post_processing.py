"""The post-processing check: a replay with other records and forced releases must send
the same messages (p4bench.privacy.post_processing), run by the runner once per plugin
version (p4bench.privacy.verification) and by the conformance kit."""

from __future__ import annotations

import json

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine.method_kit import draw_batch, per_row
from p4bench.engine.state import flatten
from p4bench.engine.training import batch_gradient, distillation_loss, logits_of
from p4bench.privacy.post_processing import check_post_processing, replaced_records, run_check
from p4bench.privacy.tape import ReleaseTape, ReplayDiverged
from p4bench.run.runner import run
from p4bench.testing.runs import resolve_plugin
from p4bench_baselines.dsgt import DPDSGD

BUILT_IN_PRIVATE = (
    "centralized",
    "dp-cga",
    "dp-dsgd",
    "dp-dsgt",
    "fedavg",
    "feddf",
    "local",
    "muffliato",
    "p2p-fl",
    "p4",
    "pdsl",
    "proxyfl",
    "scaffold",
)


def _non_dp_step(method, params, train, ctx):
    """One plain gradient step on a batch: what a method may do to its *personal* model."""
    x, y, mask = draw_batch(ctx, train)
    loss, grads = ctx.loss_and_grad(params, x, y, mask.float())
    return {k: v - method.config.lr * grads[k] for k, v in params.items()}, loss.detach().double()


class TrainsWithoutDP(DPDSGD):
    """An honest mistake: trains through `ctx.loss_and_grad`, as the method guide shows,
    and never calls `ctx.dp`."""

    name = "test-trains-without-dp"

    def local_update(self, state, train, ctx):
        params, loss = _non_dp_step(self, state["params"], train, ctx)
        return {**state, "params": params, "iteration": state["iteration"] + 1}, loss


class AddsNonDPStep(DPDSGD):
    """A DP step, then one non-DP step on the shared model it gossips."""

    name = "test-adds-non-dp-step"

    def local_update(self, state, train, ctx):
        state, loss = super().local_update(state, train, ctx)
        params, _ = _non_dp_step(self, state["params"], train, ctx)
        return {**state, "params": params}, loss


class SendsMixture(DPDSGD):
    """Keeps a non-DP personal model and gossips the mixture of it with the DP model."""

    name = "test-sends-mixture"

    def init_client_state(self, train, ctx):
        state = super().init_client_state(train, ctx)
        return {**state, "personal": {k: v.clone() for k, v in state["params"].items()}}

    def local_update(self, state, train, ctx):
        state, loss = super().local_update(state, train, ctx)
        personal, _ = _non_dp_step(self, state["personal"], train, ctx)
        return {**state, "personal": personal}, loss

    def outgoing(self, exchange, state, ctx):
        messages = super().outgoing(exchange, state, ctx)
        mixture = {k: 0.5 * (state["params"][k] + state["personal"][k]) for k in state["params"]}
        sender = torch.searchsorted(ctx.rows, messages.src)  # the row of each message's sender
        payload = {
            **messages.payload,
            **{k: v[sender] for k, v in flatten(mixture, "update.").items()},
        }
        return type(messages)(messages.src, messages.dst, payload)


class HiddenTeacher(DPDSGD):
    """A DP step whose loss distils from a personal model trained without DP on the same
    records (ProxyFL's paper teacher), undeclared: every message is a function of the
    releases, but a record moves other records' clipped terms inside them."""

    name = "test-hidden-teacher"

    def init_client_state(self, train, ctx):
        state = super().init_client_state(train, ctx)
        return {**state, "personal": {k: v.clone() for k, v in state["params"].items()}}

    def local_update(self, state, train, ctx):
        x, y, mask = draw_batch(ctx, train)
        teacher = logits_of(ctx.model, state["personal"], x)
        grads, loss, done = batch_gradient(
            ctx, state["params"], x, y, mask, train, distillation_loss(0.5), teacher
        )
        params = {
            k: v - self.config.lr * grads[k] * per_row(done, v) for k, v in state["params"].items()
        }
        personal, _ = _non_dp_step(self, state["personal"], train, ctx)
        return {
            **state,
            "params": params,
            "personal": personal,
            "iteration": state["iteration"] + 1,
        }, loss


def _check(method_cls, **changes):
    name, _, pm = resolve_plugin("method", method_cls)
    config = RunConfig(
        method=name,
        epsilon=8.0,
        clients=4,
        rounds=2,
        local_steps=2,
        eval_fraction=0.0,
        accountant="rdp",
        **changes,
    )
    return check_post_processing(config, run, pm)


@pytest.mark.parametrize("method_cls", [TrainsWithoutDP, AddsNonDPStep, SendsMixture])
def test_a_method_that_sends_more_than_its_releases_fails_naming_the_message(method_cls):
    result = _check(method_cls)
    assert result.status == "failed" and not result.passed
    first = result.findings[0]
    # the round, the exchange, the sender, the receiver and the payload entry
    assert "exchange 'gossip'" in first and "message client" in first and "'update." in first, first
    assert "post-processing check failed" in result.reason()


def test_the_honest_parent_of_those_methods_passes():
    result = _check(DPDSGD)
    assert (
        result.status == "verified"
        and result.findings == []
        and result.messages > 0
        and result.releases > 0
    )


@pytest.mark.parametrize("method", BUILT_IN_PRIVATE)
def test_every_built_in_private_method_passes(method):
    result = run_check(RunConfig(method=method, epsilon=8.0), run)
    assert result.status == "verified", result.findings
    # batch clipping (PDSL's and DP-CGA's default) has no per-record term to take out
    # and P2P-FL's private validation scores are a sum of per-record outcomes outside any clipped gradient sum
    expected = {"pdsl": "not checked", "dp-cga": "not checked", "p2p-fl": "partly checked"}.get(
        method, "verified"
    )
    assert result.isolation == expected, result.notes
    assert result.releases > 0 and (result.messages > 0 or method == "local")


def test_a_teacher_trained_without_dp_fails_the_isolation_replay_naming_the_release():
    """Post-processing holds for it (every message comes from the releases): only the
    isolation replay sees the leak, for a third-party method and for ProxyFL's and P4's paper teacher."""
    paper_teachers = [
        run_check(RunConfig(method=m, epsilon=8.0, options={"teacher": "private"}), run)
        for m in ("proxyfl", "p4")
    ]
    for result in (_check(HiddenTeacher), *paper_teachers):
        assert result.status == "failed" and result.isolation == "failed", result.findings
        assert (
            result.findings[0].startswith("record isolation: clipped sum ")
            and "(phase '" in result.findings[0]
        )
        assert "batch row " in result.findings[0] and "differs (norm" in result.findings[0]
    honest = run_check(
        RunConfig(method="proxyfl", epsilon=8.0, options={"teacher": "last-proxy"}), run
    )
    assert honest.status == "verified" and honest.isolation == "verified", honest.findings


def test_the_isolation_replay_changes_a_random_half_and_keeps_their_terms_out_of_the_kept_sums():
    from p4bench.data.federated import ClientTensors
    from p4bench.privacy.isolation import (
        ChangedRecords,
        changed_slots,
        excluding,
        features_at,
        kept_mask,
        with_changed_records,
    )

    x = torch.arange(2 * 40 * 3, dtype=torch.float32).reshape(2, 40, 3)
    train = ClientTensors(x, torch.zeros(2, 40, dtype=torch.int64), torch.tensor([40, 30]))
    replacement = ClientTensors(-x - 1, torch.ones(2, 40, dtype=torch.int64), train.n)
    replacement.x[0, 5] = x[
        1, 7
    ]  # a replacement equal to a record: slot 5 of client 0 stays unchanged
    slots = changed_slots(train, replacement, seed=3)
    assert (
        not slots[0, 5] and not slots[1, 30:].any() and 20 <= int(slots.sum()) <= 50
    )  # about half, drawn
    assert torch.equal(slots, changed_slots(train, replacement, seed=3))  # the seed's draw
    assert not torch.equal(slots, changed_slots(train, replacement, seed=4))
    changed = with_changed_records(train, replacement, slots)
    assert torch.equal(changed.x[slots], replacement.x[slots]) and torch.equal(
        changed.x[~slots], x[~slots]
    )
    batch, mask = x[:, :6], torch.ones(2, 6)
    assert kept_mask(batch, mask) is None  # outside a checked run: nothing computed
    with excluding(ChangedRecords(features_at(train, slots))) as records:
        kept = kept_mask(batch, mask)
        assert (
            kept is not None
            and torch.equal(kept, (~slots[:, :6]).float())
            and records.matched == int(slots[:, :6].sum())
        )


def test_the_check_finds_the_documented_leak_of_pdsl_local_val():
    """pdsl-local-val declares its Shapley weights read Q_i outside the ledger: the
    replay sees it in the cross-gradient messages, without reading the declaration."""
    result = run_check(RunConfig(method="pdsl-local-val", epsilon=8.0), run)
    assert result.status == "failed" and "exchange 'gossip'" in result.findings[0]


def test_central_dp_exempts_only_the_raw_sums_sent_to_the_trusted_server():
    result = run_check(RunConfig(method="centralized", epsilon=8.0), run)
    # 4 clients x 2 rounds x 2 steps: the uploads are exempt, the broadcasts compared
    assert result.status == "verified" and result.exempt == 16 and result.messages == 16


def test_p4_is_checked_on_the_fused_path_it_runs():
    """Its fused kernels declare the state their releases update: forced as a whole, and
    the bucketed kernel reports its kept clipped sums for the isolation replay."""
    result = run_check(RunConfig(method="p4", epsilon=8.0), run)
    assert result.status == "verified" and result.isolation == "verified", result.findings
    assert not any("fused=false" in note for note in result.notes)


def test_replaced_records_differ_everywhere_and_keep_the_counts():
    from p4bench.data.federated import ClientTensors

    x = torch.arange(24, dtype=torch.float32).reshape(3, 4, 2)
    y = torch.tensor([[0, 1, 2, 0], [1, 1, 0, 2], [2, 0, 1, 1]])
    train = ClientTensors(x, y, torch.tensor([4, 3, 4]))
    other = replaced_records(train, 3)
    assert torch.equal(other.n, train.n) and other.x.shape == x.shape
    assert not torch.equal(other.x[0], x[0]) and bool((other.y != y).all())


def test_a_replay_refuses_a_different_sequence_of_releases():
    recorded = ReleaseTape()
    recorded.release("add_noise", [torch.ones(2, 3)])
    replay = ReleaseTape(recorded.values)
    with pytest.raises(ReplayDiverged, match="shapes"):
        replay.release("add_noise", [torch.ones(2, 4)])
    forced = ReleaseTape(recorded.values)
    value = torch.zeros(2, 3)
    forced.release("add_noise", [value])
    assert torch.equal(value, torch.ones(2, 3)) and forced.finished
    with pytest.raises(ReplayDiverged, match="replay only"):
        forced.release("add_noise", [value])


def test_the_runner_verifies_once_and_uncertifies_a_failing_method(verify_on):
    name, _, pm = resolve_plugin("method", SendsMixture)
    config = RunConfig(
        method=name, epsilon=8.0, clients=4, rounds=2, local_steps=1, accountant="rdp"
    )
    result = run(config, plugin_manager=pm, track=False)
    assert (
        result.summary["post_processing"] == "failed"
        and result.summary["epsilon_certified"] is False
    )
    assert "post-processing check failed" in result.summary["uncertified_reason"]
    cached = json.loads(verify_on.read_text())
    assert len(cached) == 1 and next(iter(cached.values()))["status"] == "failed"
    again = run(config.replace(seed=3), plugin_manager=pm, track=False)  # the cached verdict
    assert (
        again.summary["post_processing"] == "failed" and json.loads(verify_on.read_text()) == cached
    )


def test_the_runner_reports_a_verified_method(verify_on):
    result = run(RunConfig(method="fedavg", epsilon=8.0, clients=4, rounds=1), track=False)
    assert (
        result.summary["post_processing"] == "verified"
        and result.summary["epsilon_certified"] is True
    )


def test_without_verification_the_epsilon_is_uncertified(monkeypatch, capsys, results_dir):
    from p4bench.cli import main

    monkeypatch.setenv("P4BENCH_VERIFY", "0")
    with pytest.raises(SystemExit):
        main(
            [
                "run",
                "--method",
                "fedavg",
                "--epsilon",
                "8",
                "--clients",
                "4",
                "--rounds",
                "1",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["post_processing"] == "not verified" and summary["epsilon_certified"] is False
    assert "P4BENCH_VERIFY=0" in summary["uncertified_reason"] and summary["verify"] == "off"


def test_the_conformance_kit_runs_the_check():
    from p4bench.testing import check_method

    failing = check_method(SendsMixture, checks=["post-processing"], raise_on_failure=False)
    assert not failing.passed and "exchange 'gossip'" in str(failing)
    assert check_method("p4", checks=["post-processing"], raise_on_failure=False).passed


class StepsTwice(DPDSGD):
    """Two DP steps per iteration, while its privacy_plan() declares one."""

    name = "test-steps-twice"

    def local_update(self, state, train, ctx):
        state, _ = super().local_update(state, train, ctx)
        return super().local_update(state, train, ctx)


def test_more_releases_than_the_plan_declares_is_uncertified():
    """With a target epsilon the budget refuses the extra releases; with a given noise
    multiplier nothing stops them, and the plan the run was set up with is wrong."""
    name, _, pm = resolve_plugin("method", StepsTwice)
    result = run(
        RunConfig(
            method=name, noise_multiplier=1.0, clients=4, rounds=2, local_steps=1, accountant="rdp"
        ),
        plugin_manager=pm,
        track=False,
    )
    assert result.summary["epsilon_certified"] is False
    assert (
        "a client made 4 releases in phase 'train'; privacy_plan() declares 2"
        in result.summary["uncertified_reason"]
    )


def test_p4s_span_path_is_forced_as_a_whole():
    result = check_post_processing(
        RunConfig(
            method="p4",
            epsilon=8.0,
            clients=4,
            rounds=2,
            local_steps=2,
            eval_fraction=0.0,
            accountant="rdp",
            options={"fused": "span"},
        ),
        run,
    )
    assert result.status == "verified", result.findings
    # the grouping's clipped sums are compared; the span kernel clips in n-space, with no kept sum to compare
    assert result.isolation == "partly checked" and any(
        "span" in n or "own kernels" in n for n in result.notes
    ), result.notes


def test_the_check_of_a_device_run_leaves_out_the_runtimes_own_options():
    from p4bench.privacy.post_processing import check_config

    config = RunConfig(
        method="p4",
        clients=4,
        runtime="device",
        options={"device_local_peers": 4, "device_exchange_timeout_s": 30, "group_size": 4},
    )
    checked, _ = check_config(config)
    assert checked.runtime == "simulation" and not any(
        k.startswith("device_") for k in checked.options
    )
    assert checked.options["group_size"] == 4
