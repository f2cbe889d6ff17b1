"""Baselines: every method runs with and without DP, and each shows its defining property
on a small problem (SCAFFOLD vs FedAvg under drift, exact consensus of DSGT, ProxyFL's
schedule and private model, pooled SGD of the centralized baseline)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p4bench.engine.network import InProcessNetwork
from p4bench.engine.runtimes import SimulationRuntime
from p4bench.engine.training import batched_loss_and_grad
from p4bench.errors import ConfigError, IncompatibleError
from p4bench.hookspecs import hookimpl
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.models import LinearSoftmax
from p4bench.run.runner import prepare, run
from p4bench.topology import exponential_shift

BASELINES = ("local", "centralized", "fedavg", "scaffold", "proxyfl", "dp-dsgt", "dp-dsgd")


@pytest.fixture(autouse=True)
def one_thread():
    """These runs are many tiny kernels: one thread avoids contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _synthetic(small_config, **changes):
    """Strongly heterogeneous Synthetic(1, 1): every client its own generating model."""
    options = {"synthetic_dim": 5, "synthetic_classes": 3, **changes.pop("options", {})}
    base = dict(
        dataset="synthetic",
        partitioner="natural",
        clients=6,
        samples_per_client=40,
        eval_fraction=0.0,
    )
    return small_config(**{**base, **changes, "options": options})


def _pooled(result):
    """(model, x, y, weight) of the pooled training data of all clients as one row."""
    data = result.info.data
    x = data.train.x.reshape(1, -1, *data.feature_shape)
    return (
        LinearSoftmax(data.feature_shape, data.num_classes),
        x,
        data.train.y.reshape(1, -1),
        data.train.mask.reshape(1, -1).float(),
    )


def _pooled_loss_and_grad_norm(result, params):
    model, x, y, w = _pooled(result)
    loss, grads = batched_loss_and_grad(model, params, x, y, w)
    return float(loss), float(torch.cat([g.flatten() for g in grads.values()]).norm())


def _pooled_optimum(result) -> float:
    model, x, y, w = _pooled(result)
    params = {
        k: v.clone().requires_grad_(True)
        for k, v in model.init(torch.Generator().manual_seed(0)).items()
    }
    optimizer = torch.optim.LBFGS(
        list(params.values()), max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe"
    )

    def closure():
        optimizer.zero_grad()
        value = (
            torch.nn.functional.cross_entropy(model.forward(params, x[0]), y[0], reduction="none")
            * w[0]
        ).sum() / w.sum()
        value.backward()
        return value

    optimizer.step(closure)
    return float(closure().detach())


class ReleaseCounter:
    def __init__(self, clients):
        self.steps = np.zeros(clients, dtype=int)
        self.rates = set()

    @hookimpl
    def privacy_release(self, run, release):
        self.steps[list(release.clients)] += release.steps
        self.rates.add(release.sample_rate)


# -- every method, with and without DP ---------------------------------------------------------


def test_every_baseline_runs_with_and_without_dp(verify_full, small_config):
    for name in BASELINES:
        plain = run(small_config(method=name, rounds=2, no_dp=True), track=False).summary
        private = run(small_config(method=name, rounds=2, epsilon=6.0), track=False).summary
        assert plain["epsilon"] is None and 0 <= plain["accuracy_mean"] <= 1, name
        assert plain["private"] is False and plain["epsilon_certified"] is False, name
        assert private["private"] and private["epsilon_certified"], name
        assert (
            0 < private["epsilon"] <= 6.0
            and private["epsilon_rdp"] > 0
            and private["clients_stopped"] == 0
        ), name
        assert (plain["bytes_sent"] == 0) == (name == "local"), name
        assert private["noise_multiplier"] > 0 and private["seconds_per_phase"], name


def test_cli_json_for_a_private_baseline(capsys, results_dir):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "dp-dsgt",
                "--clients",
                "6",
                "--rounds",
                "2",
                "--epsilon",
                "5",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    out, _ = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert (
        (info.value.code or 0) == 0
        and summary["method"] == "dp-dsgt"
        and 0 < summary["epsilon"] <= 5
    )


def test_capabilities_gate_defenses():
    registry = Registry(create_plugin_manager(autoload=False))
    expected = {  # (shares individual updates, has aggregator, personalized, uses server)
        "local": (False, False, True, False),
        "centralized": (False, False, False, True),
        "fedavg": (True, True, False, True),
        "scaffold": (True, True, False, True),
        "proxyfl": (True, False, True, False),
        "dp-dsgt": (True, True, False, False),
        "dp-dsgd": (True, True, False, False),
    }
    for name, flags in expected.items():
        c = registry.get("method", name).capabilities
        assert (
            c.shares_individual_updates,
            c.has_aggregator,
            c.personalized,
            c.uses_server,
        ) == flags, name
    from p4bench.config import RunConfig

    for name in ("proxyfl", "centralized", "local"):
        with pytest.raises(IncompatibleError):
            prepare(RunConfig(method=name, defense="m-krum", clients=6), registry)


@pytest.mark.parametrize(
    "method, options, private",
    [
        ("centralized", {}, True),
        ("scaffold", {"warm_start": True}, True),
        ("proxyfl", {"proxy_update": "replace"}, True),
        ("dp-dsgt", {"mixing_order": "sequential", "topology": "ring"}, False),
        ("dp-dsgd", {"topology": "ring"}, True),
    ],
)
def test_batched_and_per_client_runtimes_agree(small_config, method, options, private):
    config = small_config(
        method=method,
        clients=6,
        rounds=2,
        client_rate=0.5,
        partitioner="alpha",
        options=options,
        epsilon=8.0 if private else None,
    )
    batched = run(config, track=False)
    per_client = run(
        config.replace(runtime="bytes" if method == "dp-dsgt" else "reference"), track=False
    )
    for key, value in batched.outcome.final_params.items():
        assert torch.allclose(value, per_client.outcome.final_params[key], atol=1e-5), (method, key)
    assert batched.outcome.bytes_sent == per_client.outcome.bytes_sent > 0


def test_planned_releases_are_what_the_ledger_sees(small_config):
    cases = {  # method -> (options, DP steps per client)
        "dp-dsgt": ({"iterations": 3}, 3 * 3),
        "proxyfl": ({}, 2 * 3),
        "centralized": ({}, 2 * 3),
        "scaffold": ({"warm_start": True}, None),
    }
    for name, (options, steps) in cases.items():
        counter = ReleaseCounter(8)
        pm = create_plugin_manager(autoload=False)
        result = run(
            small_config(method=name, rounds=3, epsilon=5.0, options=options),
            observers=[counter],
            plugin_manager=pm,
            track=False,
        )
        assert counter.rates == {0.2}, name
        if steps is not None:
            assert (counter.steps == steps).all(), (name, counter.steps)
        else:  # warm start: K steps for everyone, then K per round while selected (l = 1)
            assert (counter.steps == 2 + 2 * 3).all(), counter.steps
        assert result.summary["epsilon"] <= 5.0 and result.summary["clients_stopped"] == 0


# -- defining properties ------------------------------------------------------------------------


def test_scaffold_beats_fedavg_under_client_drift(small_config):
    """Heterogeneous clients, K = 20 local steps: control variates remove the drift."""
    results = {}
    for name in ("fedavg", "scaffold"):
        config = _synthetic(
            small_config,
            method=name,
            clients=10,
            samples_per_client=50,
            rounds=15,
            local_steps=20,
            lr=1.0,
            options={"synthetic_dim": 10, "synthetic_classes": 5},
        )
        result = run(config, track=False)
        params = {k: v[:1] for k, v in result.outcome.final_params.items()}
        results[name] = (
            _pooled_loss_and_grad_norm(result, params)[0],
            result.summary["accuracy_mean"],
        )
    assert results["scaffold"][0] < results["fedavg"][0] - 0.2, results
    assert results["scaffold"][1] > results["fedavg"][1] + 0.05, results


def test_dsgt_synchronous_complete_graph_keeps_nodes_equal_sequential_does_not(small_config):
    sync = run(small_config(method="dp-dsgt", partitioner="alpha", similarity=0.0), track=False)
    for value in sync.outcome.final_params.values():
        assert torch.allclose(value, value[:1].expand_as(value), atol=1e-6)
    seq = run(
        small_config(
            method="dp-dsgt",
            partitioner="alpha",
            similarity=0.0,
            options={"mixing_order": "sequential"},
        ),
        track=False,
    )
    spread = max(
        float((v - v.mean(0, keepdim=True)).abs().max()) for v in seq.outcome.final_params.values()
    )
    assert spread > 1e-4  # the authors' in-place mixing does not reach the exact average


def test_dsgt_and_dsgd_converge_to_the_consensus_optimum(small_config):
    """Full-batch gradients on a ring: DSGT reaches the pooled optimum at a constant step;
    DSGD is biased at a constant step and reaches consensus near it with decaying steps."""
    base = dict(
        rounds=80, local_steps=5, data_rate=1.0, lr=1.0, no_dp=True, options={"topology": "ring"}
    )
    outcomes = {}
    for label, method, extra in (
        ("dsgt", "dp-dsgt", {}),
        ("dsgd", "dp-dsgd", {}),
        ("dsgd-decay", "dp-dsgd", {"lr_final": 0.02}),
    ):
        config = _synthetic(
            small_config, method=method, **{**base, "options": {**base["options"], **extra}}
        )
        result = run(config, track=False)
        params = result.outcome.final_params
        mean = {k: v.mean(0, keepdim=True) for k, v in params.items()}
        spread = max(float((params[k] - mean[k]).abs().max()) for k in params)
        outcomes[label] = (_pooled_loss_and_grad_norm(result, mean)[0], spread)
    optimum = _pooled_optimum(result)
    assert outcomes["dsgt"][0] - optimum < 1e-3 and outcomes["dsgt"][1] < 1e-3, (optimum, outcomes)
    assert outcomes["dsgd"][1] > 0.1 and outcomes["dsgd"][0] - optimum > 0.01, (optimum, outcomes)
    assert outcomes["dsgd-decay"][1] < 0.05 and outcomes["dsgd-decay"][0] - optimum < 0.03, (
        optimum,
        outcomes,
    )


def test_sequential_matrices_reproduce_the_authors_in_place_loops():
    from p4bench.topology import RingGraph
    from p4bench_baselines.dsgt import iteration_matrices, mixing_matrix

    weights = mixing_matrix(RingGraph().edges(5, 0, np.random.default_rng(0)), "metropolis")
    a, b, c = iteration_matrices(weights, "sequential")
    gen = torch.Generator().manual_seed(0)
    x, y, d = (torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    w, rate = torch.from_numpy(weights), 0.3
    loop_x, loop_y = x.clone(), y.clone()
    for i in range(5):  # x_i <- sum_j W_ij (x_j - a y_j), in place, node by node
        loop_x[i] = (w[i].unsqueeze(1) * (loop_x - rate * y)).sum(0)
    for i in range(5):  # y_i <- sum_j W_ij y_j + d_i, in place
        loop_y[i] = (w[i].unsqueeze(1) * loop_y).sum(0) + d[i]
    assert torch.allclose(a @ x - rate * (b @ y), loop_x)
    assert torch.allclose(a @ y + c @ d, loop_y)
    assert torch.allclose(
        a.sum(1), torch.ones(5, dtype=torch.float64)
    )  # still a weighted mean of models


class RecordingRuntime(SimulationRuntime):
    """The simulator, recording every delivered message with the senders' private models."""

    def network(self):
        runtime = self

        class Recording(InProcessNetwork):
            def exchange(self, exchange, phase, round_index, outgoing):
                state = runtime.driver.groups[0].state if runtime.driver else None
                runtime.log.append(
                    (
                        exchange,
                        round_index,
                        outgoing,
                        {k: v.clone() for k, v in state["private"].items()},
                    )
                )
                return super().exchange(exchange, phase, round_index, outgoing)

        return Recording()


@pytest.mark.parametrize("mode", ["average", "replace"])
def test_proxyfl_pushes_follow_the_exponential_graph_and_keep_the_private_model(small_config, mode):
    from p4bench.engine.state import vectorize

    config = small_config(
        method="proxyfl", clients=8, rounds=4, epsilon=10.0, options={"proxy_update": mode}
    )
    prepared = prepare(config, Registry(create_plugin_manager(autoload=False)))
    runtime = RecordingRuntime()
    runtime.log = []
    outcome = runtime.execute(prepared.job, lambda report: None)
    assert [(e, r) for e, r, _, _ in runtime.log] == [("push", r) for r in range(4)]
    for _, round_index, messages, private in runtime.log:
        assert all(k.startswith("update.") for k in messages.payload)
        out = messages.src != messages.dst
        shift = exponential_shift(8, round_index)
        assert sorted(messages.src[out].tolist()) == list(range(8))
        assert torch.equal(messages.dst[out], (messages.src[out] + shift) % 8)
        assert int((~out).sum()) == (8 if mode == "average" else 0)  # own proxy kept for averaging
        sent = torch.cat(
            [messages.payload[k].flatten(start_dim=1) for k in sorted(messages.payload)], dim=1
        )
        own_private = vectorize(private)[messages.src]
        assert (
            not torch.isclose(sent, own_private, atol=1e-6).all(dim=1).any()
        )  # the private model is never sent
    _, last_round, messages, _ = runtime.log[-1]
    sent = {
        (int(s), int(d)): torch.cat(
            [messages.payload[k][i].flatten() for k in sorted(messages.payload)]
        )
        for i, (s, d) in enumerate(zip(messages.src, messages.dst))
    }
    shift = exponential_shift(8, last_round)
    final = vectorize(outcome.final_state["proxy"])
    for k in range(8):
        received = sent[((k - shift) % 8, k)]
        expected = received if mode == "replace" else (received + sent[(k, k)]) / 2
        assert torch.allclose(final[k], expected, atol=1e-6)
    # the deployed model is the private one, and it differs from the proxy
    assert not torch.allclose(vectorize(outcome.final_params), final)


def test_centralized_is_gradient_descent_on_the_pooled_data(small_config):
    config = small_config(
        method="centralized",
        partitioner="alpha",
        similarity=0.0,
        data_rate=1.0,
        lr=0.3,
        rounds=2,
        local_steps=3,
    )
    result = run(config, track=False)
    model, x, y, w = _pooled(result)
    params = {
        k: v.unsqueeze(0) for k, v in model.init(torch.Generator().manual_seed(config.seed)).items()
    }
    for _ in range(6):
        _, grads = batched_loss_and_grad(model, params, x, y, w)
        params = {k: params[k] - 0.3 * grads[k] for k in params}
    for key, value in result.outcome.final_params.items():
        assert torch.allclose(value, params[key].expand_as(value), atol=1e-5), key


def test_bad_options_are_refused(small_config):
    for method, options in (
        ("dp-dsgt", {"mixing_order": "shuffled"}),
        ("proxyfl", {"proxy_update": "merge"}),
        ("scaffold", {"control_update": "other"}),
        ("dp-dsgd", {"topology": "ring", "mixing": "random"}),
    ):
        with pytest.raises(ConfigError):
            run(small_config(method=method, options=options), track=False)
    with pytest.raises(IncompatibleError):  # Metropolis-Hastings needs an undirected graph
        run(small_config(method="dp-dsgd", options={"topology": "exponential"}), track=False)


def test_the_central_server_adds_the_runs_noise_whatever_the_clients_send(small_config):
    """The server's noise std is the run's (`ctx.dp_settings`), known to every party: a
    client that sends a noise std of 0 (a stolen key) cannot switch the noise off."""
    from types import SimpleNamespace

    from p4bench.engine.messages import Messages
    from p4bench.engine.state import flatten
    from p4bench.models import LinearSoftmax
    from p4bench.privacy.mechanism import DPSettings
    from p4bench_baselines.centralized import GRADIENT, Centralized

    config = small_config(method="centralized", clip=1.0)
    method = Centralized(config, LinearSoftmax((4,), 3), num_clients=2)
    sums = {k: torch.ones(2, *v.shape) for k, v in method.initial_params().items()}

    def server_update(std_sent: float | None, settings: DPSettings | None) -> torch.Tensor:
        state = method.init_server_state(None)  # a fresh noise stream each time: the same draws
        payload = {**flatten(sums, GRADIENT), "weight": torch.full((2,), 4.0, dtype=torch.float64)}
        if std_sent is not None:
            payload["noise_std"] = torch.full(
                (2,), std_sent, dtype=torch.float64
            )  # what an old or lying client sends
        inbox = Messages(torch.tensor([0, 1]), torch.full((2,), -1), payload)
        new = method.server_receive("upload", state, inbox, SimpleNamespace(dp_settings=settings))
        return torch.cat([v.flatten() for v in new["params"].values()])

    settings = DPSettings(clip=1.0, noise_multiplier=2.0, neighbouring="add-remove")
    honest = server_update(None, settings)
    assert torch.equal(server_update(0.0, settings), honest)  # the sent std is not read
    assert not torch.equal(
        server_update(None, None), honest
    )  # and the run's is: without DP, no noise


def test_the_central_server_keeps_each_clients_first_batch_share(small_config):
    """A client cannot shrink the share it declared to scale the server's step: the share
    stays the one of its first upload, and an upload stating another is rejected."""
    from types import SimpleNamespace

    from p4bench.engine.messages import Messages
    from p4bench.engine.state import flatten, vectorize
    from p4bench.models import LinearSoftmax
    from p4bench_baselines.centralized import GRADIENT, Centralized

    method = Centralized(
        small_config(method="centralized", lr=1.0), LinearSoftmax((4,), 3), num_clients=2
    )
    sums = {k: torch.ones(2, *v.shape) for k, v in method.initial_params().items()}
    rejected: list[tuple[str, list[int]]] = []
    ctx = SimpleNamespace(
        dp_settings=None, reject=lambda reason, ids: rejected.append((reason, ids.tolist()))
    )

    def upload(state, shares):
        payload = {**flatten(sums, GRADIENT), "weight": torch.tensor(shares, dtype=torch.float64)}
        return method.server_receive(
            "upload", state, Messages(torch.tensor([0, 1]), torch.full((2,), -1), payload), ctx
        )

    first = upload(method.init_server_state(None), [4.0, 4.0])
    step = vectorize(method.init_server_state(None)["params"]) - vectorize(first["params"])
    assert torch.allclose(step, torch.full_like(step, 2 / 8))  # (1 + 1) / (4 + 4)
    second = upload(
        first, [1e-6, 4.0]
    )  # client 0 now claims a tiny share: a 10^6 times larger step
    assert rejected == [("changed weight", [0])]
    step = vectorize(first["params"]) - vectorize(second["params"])
    assert torch.allclose(
        step, torch.full_like(step, 1 / 4)
    )  # client 1 alone, with its pinned share
