"""Verification of the run that ran (`--verify full`, p4bench.privacy.run_verification):
leaks that start late, appear only in larger federations or live in a helper module are
found at the run's own size; the stand-in says it is one; off is uncertified."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
import torch
from test_post_processing import (
    SendsMixture,
)  # the tests folder is on sys.path (no __init__.py: rootdir insertion)

from p4bench.config import RunConfig
from p4bench.run.runner import run
from p4bench.testing.runs import resolve_plugin
from p4bench_baselines.dsgt import DPDSGD


class LeaksFromRoundThree(SendsMixture):
    """Gossips the mixture with its non-DP personal model from its third round on."""

    name = "test-leaks-from-round-three"

    def outgoing(self, exchange, state, ctx):
        return (
            super().outgoing(exchange, state, ctx)
            if ctx.round >= 2
            else DPDSGD.outgoing(self, exchange, state, ctx)
        )


class LeaksAboveEightClients(SendsMixture):
    """Gossips the mixture only in federations of more than 8 clients."""

    name = "test-leaks-above-eight"

    def outgoing(self, exchange, state, ctx):
        return (
            super().outgoing(exchange, state, ctx)
            if ctx.num_clients > 8
            else DPDSGD.outgoing(self, exchange, state, ctx)
        )


def _config(name, **changes):
    base = dict(
        method=name,
        epsilon=8.0,
        rounds=4,
        local_steps=2,
        clients=10,
        accountant="rdp",
        verify="full",
    )
    base.update(changes)
    return RunConfig(**base)


@pytest.mark.parametrize(
    ("method_cls", "first"), [(LeaksFromRoundThree, 2), (LeaksAboveEightClients, 0)]
)
def test_a_leak_the_stand_in_misses_is_found_at_the_runs_size(method_cls, first, verify_on):
    name, _, pm = resolve_plugin("method", method_cls)
    stand_in = run(_config(name, verify="stand-in"), plugin_manager=pm, track=False).summary
    # the 4-client, 2-round stand-in sees no leak, and says what it checked: no certificate
    assert stand_in["post_processing"] == "verified on a 4-client, 2-round stand-in"
    assert stand_in["epsilon_certified"] is False and "stand-in" in stand_in["uncertified_reason"]
    full = run(_config(name), plugin_manager=pm, track=False).summary
    assert full["post_processing"] == "failed" and full["epsilon_certified"] is False
    reason = full["uncertified_reason"]
    # the round, the exchange, the sender and the payload entry
    assert (
        f"phase 'train' round {first}, exchange 'gossip': message client " in reason
        and "'update." in reason
    ), reason
    assert full["verification_scope"] == "run" and full["verify"] == "full"


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


@pytest.mark.parametrize("method", BUILT_IN_PRIVATE)
def test_every_built_in_private_method_passes_on_the_run_itself(method, verify_on):
    summary = run(
        RunConfig(
            method=method, epsilon=8.0, clients=10, rounds=3, local_steps=2, accountant="rdp"
        ),
        track=False,
    ).summary
    assert summary["post_processing"] == "verified" and summary["verification_scope"] == "run", (
        summary["uncertified_reason"]
    )
    assert summary["epsilon_certified"] is True, summary["uncertified_reason"]


def test_an_honest_outside_gossip_method_stays_certified_at_the_runs_size(verify_on):
    name, _, pm = resolve_plugin("method", DPDSGD)
    summary = run(_config(name), plugin_manager=pm, track=False).summary
    assert summary["epsilon_certified"] is True, summary["uncertified_reason"]
    assert summary["post_processing"] == "verified" and summary["record_isolation"] == "verified"
    assert (
        summary["verification_messages"] > 0
        and "the run itself (10 clients, 4 rounds" in summary["verification_notes"][0]
    )


def test_a_verdict_is_reused_for_another_seed_only(verify_on):
    name, _, pm = resolve_plugin("method", DPDSGD)
    first = run(_config(name, rounds=2), plugin_manager=pm, track=False).summary
    again = run(_config(name, rounds=2, seed=5), plugin_manager=pm, track=False).summary
    other = run(_config(name, rounds=3), plugin_manager=pm, track=False).summary
    assert (
        first["verification_cached"],
        again["verification_cached"],
        other["verification_cached"],
    ) == (False, True, False)
    assert len(json.loads(verify_on.read_text())) == 2


HELPER = '''
def private_share():
    """How much of the non-DP personal model goes into the message."""
    return {share}
'''

METHOD = '''
import torch
from p4bench.engine.method_kit import draw_batch
from p4bench_baselines.dsgt import DPDSGD
from p4bench.engine.state import flatten
from {package}.helper import private_share


class HelperLeak(DPDSGD):
    """Keeps a personal model trained without DP and mixes `private_share()` of it into its messages."""

    name = "test-helper-leak"

    def init_client_state(self, train, ctx):
        state = super().init_client_state(train, ctx)
        return {{**state, "personal": {{k: v.clone() for k, v in state["params"].items()}}}}

    def local_update(self, state, train, ctx):
        state, loss = super().local_update(state, train, ctx)
        x, y, mask = draw_batch(ctx, train)
        _, grads = ctx.loss_and_grad(state["personal"], x, y, mask.float())
        return {{**state, "personal": {{k: v - self.config.lr * grads[k] for k, v in state["personal"].items()}}}}, loss

    def outgoing(self, exchange, state, ctx):
        messages = super().outgoing(exchange, state, ctx)
        share = private_share()
        if not share:
            return messages
        mixed = {{k: (1 - share) * state["params"][k] + share * state["personal"][k] for k in state["params"]}}
        sender = torch.searchsorted(ctx.rows, messages.src)
        payload = {{**messages.payload, **{{k: v[sender] for k, v in flatten(mixed, "update.").items()}}}}
        return type(messages)(messages.src, messages.dst, payload)
'''


def test_editing_a_helper_module_invalidates_the_verdict(verify_on, tmp_path, monkeypatch):
    """The method's own file is unchanged; its helper starts mixing a tenth of a model
    that reads every record: the cache key covers every file of the package."""
    package = "p4bench_helper_leak_pkg"
    folder = tmp_path / "src" / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "helper.py").write_text(textwrap.dedent(HELPER.format(share="0.0")))
    (folder / "method.py").write_text(textwrap.dedent(METHOD.format(package=package)))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    module = importlib.import_module(f"{package}.method")
    try:
        name, _, pm = resolve_plugin("method", module.HelperLeak)
        honest = run(_config(name, rounds=2), plugin_manager=pm, track=False).summary
        assert honest["epsilon_certified"] is True, honest["uncertified_reason"]
        (folder / "helper.py").write_text(textwrap.dedent(HELPER.format(share="0.1")))
        importlib.reload(sys.modules[f"{package}.helper"])
        module = importlib.reload(module)
        name, _, pm = resolve_plugin("method", module.HelperLeak)
        leaking = run(_config(name, rounds=2), plugin_manager=pm, track=False).summary
        assert leaking["verification_cached"] is False
        assert leaking["post_processing"] == "failed" and leaking["epsilon_certified"] is False
        assert "exchange 'gossip': message client " in leaking["uncertified_reason"]
    finally:
        for loaded in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[loaded]


def test_verification_off_is_uncertified(monkeypatch, verify_on):
    monkeypatch.setenv("P4BENCH_VERIFY", "0")
    summary = run(RunConfig(method="dp-dsgd", clients=4, rounds=1), track=False).summary
    assert summary["epsilon_certified"] is False and summary["post_processing"] == "not verified"
    assert "P4BENCH_VERIFY=0" in summary["uncertified_reason"] and summary["verify"] == "off"


def test_noble_third_party_runs_and_is_uncertified_with_the_tight_figure_beside_it(verify_on):
    summary = run(
        RunConfig(
            method="fedavg",
            epsilon=8.0,
            clients=6,
            rounds=2,
            accountant="noble",
            options={"noble_view": "third-party"},
        ),
        track=False,
    ).summary
    assert summary["epsilon_certified"] is False and summary["post_processing"] == "verified"
    assert "noble" in summary["uncertified_reason"] and summary["epsilon_pld"] is not None


def test_the_stand_in_check_drops_the_accountants_own_options():
    from p4bench.privacy.post_processing import check_config

    checked, _ = check_config(
        RunConfig(
            method="fedavg",
            epsilon=8.0,
            accountant="noble",
            options={"noble_view": "third-party", "lr_scaling": "noble"},
        )
    )
    assert (
        checked.accountant == "rdp"
        and "noble_view" not in checked.options
        and checked.options["lr_scaling"] == "noble"
    )


def test_a_run_stopped_by_its_time_budget_is_replayed_to_the_same_round(verify_on, monkeypatch):
    from p4bench.run import session

    monkeypatch.setattr(
        session.RunSession,
        "stop_after",
        lambda self, step: (
            step >= 2
            or (self.prepared.stop_at_step is not None and step >= self.prepared.stop_at_step)
        ),
    )
    name, _, pm = resolve_plugin("method", DPDSGD)
    summary = run(_config(name, rounds=4), plugin_manager=pm, track=False).summary
    assert summary["post_processing"] == "verified", summary["uncertified_reason"]


def test_a_fused_release_without_its_state_declared_is_not_verifiable(verify_on):
    """`add_scaled_noise` on a target that may hold state besides the release cannot be
    forced unless the path declares that state (`Releases.state_before`/`state_after`)."""
    from p4bench.privacy.releases import Releases

    class UndeclaredFused(DPDSGD):
        name = "test-undeclared-fused"

        def local_update(self, state, train, ctx):
            params = {k: v.clone() for k, v in state["params"].items()}
            with Releases(ctx.dp, ctx, ctx.config.data_rate) as releases:
                releases.add_scaled_noise(params, torch.full((len(ctx.rows),), -0.01))
            return {**state, "params": params}, torch.zeros(len(ctx.rows), dtype=torch.float64)

    name, _, pm = resolve_plugin("method", UndeclaredFused)
    summary = run(_config(name, rounds=2), plugin_manager=pm, track=False).summary
    assert summary["post_processing"] == "not verifiable" and summary["epsilon_certified"] is False
