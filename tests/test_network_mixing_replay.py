"""The network mixing check (p4bench.privacy.network_mixing): in the post-processing check's
recorded run, every gossip message must equal its sender's declared state (the declared
mixture of releases and public values), so a method cannot under-declare what it mixes."""

from __future__ import annotations

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine.state import unvectorize, vectorize
from p4bench.privacy.post_processing import check_post_processing
from p4bench.run.runner import run
from p4bench.testing.runs import resolve_plugin
from p4bench_baselines.dsgt import DPDSGD
from p4bench_baselines.muffliato import Muffliato


class SendsMoreOfItsModel(DPDSGD):
    """Gossips 1.1x its model (and mixes what it receives as it should)."""

    name = "test-network-sends-more"

    def outgoing(self, exchange, state, ctx):
        scaled = {k: 1.1 * v for k, v in state["params"].items()}
        return super().outgoing(exchange, {**state, "params": scaled}, ctx)


class KeepsMoreOfItself(DPDSGD):
    """Mixes its own model with weight 0.9 + 0.1 W_ii, the received ones with 0.1 W_ij: a
    mixing matrix it does not declare (it declares W)."""

    name = "test-network-keeps-more"

    def receive(self, exchange, state, inbox, ctx):
        mixed = super().receive(exchange, state, inbox, ctx)
        own, new = vectorize(state["params"]), vectorize(mixed["params"])
        return {**mixed, "params": unvectorize(0.9 * own + 0.1 * new, state["params"])}


class AddsAStaleRelease(Muffliato):
    """Adds half of its previous iteration's step again: a release counted twice."""

    name = "test-network-stale-release"

    def local_update(self, state, train, ctx):
        before = vectorize(state["params"])
        state, loss = super().local_update(state, train, ctx)
        step = vectorize(state["params"]) - before
        previous = state.get("last_step", torch.zeros_like(step))
        params = unvectorize(vectorize(state["params"]) + 0.5 * previous, state["params"])
        return {**state, "params": params, "last_step": step}, loss


def _check(method, **options):
    name, _, pm = resolve_plugin("method", method)
    config = RunConfig(
        method=name,
        epsilon=8.0,
        clients=5,
        rounds=2,
        local_steps=2,
        eval_fraction=0.0,
        accountant="rdp",
        options={"topology": "ring", **options},
    )
    return check_post_processing(config, run, pm)


@pytest.mark.parametrize("method", [SendsMoreOfItsModel, KeepsMoreOfItself, AddsAStaleRelease])
def test_a_method_that_mixes_what_it_did_not_declare_fails_naming_the_message(method):
    result = _check(method)
    assert result.status == "failed", result.notes
    finding = next(f for f in result.findings if f.startswith("network mixing"))
    assert "round" in finding and "exchange 'gossip'" in finding and "message of client" in finding
    assert "did not declare" in finding


@pytest.mark.parametrize(
    "method, options",
    [
        ("dp-dsgd", {}),
        ("dp-dsgd", {"order": "d-psgd"}),
        ("dp-dsgd", {"mixing_order": "sequential", "mixing": "uniform"}),
        ("muffliato", {"gossip_steps": 2}),
        ("muffliato", {"topology": "exponential", "mixing": "uniform"}),  # directed
        ("dp-dsgd", {"topology": "erdos-renyi", "topology_options": {"resample": True}}),
    ],
)
def test_the_honest_gossip_methods_pass_and_say_how_many_messages_were_checked(method, options):
    result = _check(method, **options)
    assert result.status == "verified", result.findings
    note = next(n for n in result.notes if n.startswith("network mixing verified"))
    assert int(note.split(": ")[1].split()[0]) > 0


def test_a_method_that_declares_nothing_is_not_checked_and_still_passes():
    result = _check("dp-dsgt")
    assert result.status == "verified", result.findings
    assert not any("network mixing" in n for n in result.notes + result.findings)
