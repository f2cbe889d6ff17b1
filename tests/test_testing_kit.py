"""The conformance kit catches broken plugins: each broken method, attack and defense
below violates one part of the contract, and the kit must say which."""

from __future__ import annotations

import pytest
import torch

from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Messages
from p4bench.engine.state import flatten, unvectorize, vectorize
from p4bench.engine.threats import Defense, ModelReplacementAttack, weighted_mean
from p4bench.engine.training import fixed_size_batches, gather_batch
from p4bench.options import Option
from p4bench.testing import ConformanceError, check_attack, check_defense, check_method
from p4bench.testing.pytest_plugin import conformance  # noqa: F401 - the fixture, as the pytest plugin provides it
from p4bench_baselines.fedavg import FedAvg
from p4bench_baselines.local import LocalTraining

pytestmark = pytest.mark.usefixtures("fresh_registry")


class SkipsDP(LocalTraining):
    """A DP method whose local step ignores ctx.dp: no noise, no ledger entry."""

    name = "broken-skips-dp"
    default_epsilon = DEFAULT_EPSILON

    def local_update(self, state, train, ctx):
        params = state["params"]
        for _ in range(self.config.local_steps):
            index, mask = fixed_size_batches(ctx, train)
            loss, grads = ctx.loss_and_grad(
                params, gather_batch(train.x, index), gather_batch(train.y, index), mask.float()
            )
            params = {k: params[k] - self.config.lr * grads[k] for k in params}
        return {**state, "params": params}, loss.detach().double()


class LyingFedAvg(FedAvg):
    """FedAvg that claims to share no individual updates, aggregate nothing and deploy
    personalized models."""

    name = "broken-lying"
    capabilities = Capabilities(
        shares_individual_updates=False, has_aggregator=False, uses_server=True, personalized=True
    )


class ReadsTable(LocalTraining):
    """Sends its model to both ring neighbours from a shared table (`rows`) and counts
    its senders by the rows of `inbox.table`: right only when every message is its own
    table, i.e. after the byte transport."""

    name = "broken-reads-table"

    def round_steps(self, phase, round_index):
        return (LocalUpdate(), Exchange("ring"))

    def outgoing(self, exchange, state, ctx):
        count = ctx.num_clients
        sender = torch.arange(len(ctx.rows)).repeat_interleave(2)
        receiver = torch.stack([(ctx.rows + 1) % count, (ctx.rows - 1) % count], dim=1).reshape(-1)
        return Messages(
            ctx.rows[sender], receiver, flatten(state["params"], "update."), rows=sender
        )

    def receive(self, exchange, state, inbox, ctx):
        if not len(inbox):
            return state
        senders = len(
            next(iter(inbox.table.values()))
        )  # wrong: table rows, not this node's messages
        models = vectorize({k: inbox.value(k) for k in inbox.table})  # one row per message: right
        own = vectorize(state["params"])
        mixed = own.clone()
        for i, row in enumerate(torch.searchsorted(ctx.rows, inbox.dst).tolist()):
            mixed[row] += (models[i] - own[row]) / senders
        return {**state, "params": unvectorize(mixed, state["params"])}


class BadDefault(LocalTraining):
    name = "broken-option"
    options = (
        Option("rate", float, 2.0, "a rate in [0, 1] whose default is not", low=0.0, high=1.0),
    )


class UnseededAttack(ModelReplacementAttack):
    """Replaces updates with global-RNG noise (not its stream) and claims to fit any method."""

    name = "broken-unseeded"

    @classmethod
    def incompatibility(cls, capabilities):
        return None

    def replace(self, honest_model, global_model, rng):
        return torch.randn(honest_model.shape)


class AveragesPadding(Defense):
    """Averages every slot, padding included, and claims to need no aggregation point."""

    name = "broken-padding"
    needs_individual_updates = False
    filters = False

    def aggregate(self, updates, weights, mask, **identities):
        everything = torch.ones_like(mask)
        return weighted_mean(updates, everything.double()), everything


def test_a_dp_method_that_skips_ctx_dp_fails_the_ledger_check():
    with pytest.raises(ConformanceError) as info:
        check_method(SkipsDP, checks=("ledger",))
    report = info.value.report
    assert report.failed("ledger.noise") and report.failed("ledger.plan")
    assert "ctx.dp" in str(info.value) and "privacy_plan() plans 4 releases per client" in str(
        info.value
    )


def test_lying_capabilities_are_caught():
    report = check_method(LyingFedAvg, checks=("capabilities",), raise_on_failure=False)
    assert report.failed("capabilities.shares_individual_updates")
    assert report.failed("capabilities.has_aggregator")
    assert report.failed("capabilities.personalized")
    assert not report.failed("capabilities.uses_server")


def test_a_method_that_differs_under_bytes_is_caught():
    report = check_method(
        ReadsTable, checks=("runtimes", "state"), privacy=("no-dp",), raise_on_failure=False
    )
    failure = next(r for r in report.failures if r.name == "runtimes.no-dp")
    assert (
        "bytes vs simulation" in failure.message
        and "reference vs simulation" not in failure.message
    )
    assert not report.failed("state")


def test_an_option_whose_default_is_invalid_is_caught():
    report = check_method(BadDefault, checks=("options",), raise_on_failure=False)
    assert (
        report.failed("options.rate") and "default 2.0 is not valid" in report.failures[0].message
    )


def test_an_unseeded_attack_that_accepts_everything_is_caught():
    report = check_attack(
        UnseededAttack,
        methods=("fedavg", "local"),
        checks=("tamper", "needs"),
        raise_on_failure=False,
    )
    assert report.failed("tamper") and "same random stream" in report.failures[0].message
    assert report.failed("needs.local") and not report.failed("needs.fedavg")


def test_a_defense_that_averages_padding_is_caught():
    report = check_defense(
        AveragesPadding,
        methods=("fedavg", "local"),
        checks=("aggregate", "needs"),
        raise_on_failure=False,
    )
    # the shared screen restricts `kept` to the real updates; the padding still moves the mean
    assert (
        report.failed("aggregate") and "padding changes the aggregate" in report.failures[0].message
    )
    assert (
        report.failed("needs.local") and "no update ever reached it" in report.failures[-1].message
    )
    assert not report.failed("needs.fedavg")


def test_skips_and_the_pytest_fixture(conformance):  # noqa: F811 - the imported fixture
    report = conformance.method("local", checks=("state", "ledger"), skip=("ledger.plan",))
    assert report.passed and [r.name for r in report.results if r.skipped] == ["ledger.plan"]
    assert "conforms" in str(report)
