"""The DP mechanism and the per-client ledger, end to end."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p4bench import hookimpl
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.models import LinearSoftmax
from p4bench.privacy import get_accountant
from p4bench.privacy.accountants import RDPAccountant, ReleaseSegment
from p4bench.privacy.ledger import accounted_epsilon
from p4bench.privacy.mechanism import DPMechanism, DPSettings, NoiseStreams, clipped_gradient_sum
from p4bench.run.runner import run


def _mechanism(rows, std_sigma=2.0, clip=0.5, neighbouring="add-remove", seed=0):
    settings = DPSettings(clip=clip, noise_multiplier=std_sigma, neighbouring=neighbouring)

    def allow(clients, rate, phase):
        return torch.ones(len(clients), dtype=torch.bool)

    return DPMechanism(settings, NoiseStreams(seed, rows), lambda release: None, allow)


@pytest.mark.parametrize("neighbouring, factor", [("add-remove", 1.0), ("replace-one", 2.0)])
def test_noise_is_really_in_the_update(neighbouring, factor):
    """All-zero gradients (an empty batch): what is sent is pure noise of the configured std."""
    model = LinearSoftmax((64,), 10)
    mech = _mechanism([0, 1], std_sigma=1.5, clip=0.8, neighbouring=neighbouring)
    params = {
        k: v.expand(2, *v.shape).clone()
        for k, v in model.init(torch.Generator().manual_seed(0)).items()
    }
    x, y = torch.rand(2, 4, 64), torch.zeros(2, 4, dtype=torch.long)
    mask = torch.zeros(2, 4)
    expected_batch = torch.tensor([10.0, 10.0])
    grads, _ = mech.gradient(model, params, x, y, mask, expected_batch)
    target = factor * 1.5 * 0.8 / 10.0
    flat = torch.cat([grads["weight"].flatten(1), grads["bias"]], dim=1)
    for row in flat:
        assert abs(float(row.std()) / target - 1) < 0.05
        assert abs(float(row.mean())) < 0.1 * target
    assert not torch.allclose(flat[0], flat[1])  # two clients draw different noise


def test_noise_streams_are_per_client_and_reproducible():
    together = NoiseStreams(7, [0, 1, 2]).normal(100)
    alone = NoiseStreams(7, [2]).normal(100)
    assert torch.equal(together[2], alone[0])
    assert not torch.equal(NoiseStreams(8, [2]).normal(100)[0], alone[0])
    secure = NoiseStreams(7, [0, 1], secure=True).normal(20000)
    assert abs(float(secure.std()) - 1) < 0.03 and not torch.equal(secure[0], secure[1])


def test_large_draws_on_threads_give_each_row_its_own_stream_in_any_order():
    size = (1 << 22) // 3 + 1  # 4 rows x size is above the threshold for filling on threads
    streams = NoiseStreams(3, [5, 6, 7, 8])
    drawn = streams.normal(size).clone()
    for row, node in enumerate([5, 6, 7, 8]):
        assert torch.equal(drawn[row], NoiseStreams(3, [node]).normal(size)[0])
    reordered = NoiseStreams(3, [5, 6, 7, 8]).take(torch.tensor([2, 0, 3, 1])).normal(size)
    assert torch.equal(reordered, drawn[[2, 0, 3, 1]])


def test_scaled_noise_is_the_same_draw_scaled_per_row():
    settings = DPSettings(clip=1.0, noise_multiplier=1.5, neighbouring="replace-one")

    def mechanism():
        return DPMechanism(
            settings,
            NoiseStreams(0, [0, 1, 2]),
            lambda release: None,
            lambda *a: torch.ones(3, dtype=torch.bool),
        )

    plain = {"weight": torch.zeros(3, 2, 4), "bias": torch.zeros(3, 2)}
    scaled = {"weight": torch.ones(3, 2, 4), "bias": torch.ones(3, 2)}
    mechanism().add_scaled_noise(plain, None)
    mechanism().add_scaled_noise(scaled, torch.tensor([0.5, -2.0, 0.0]))
    for key in plain:
        factor = torch.tensor([0.5, -2.0, 0.0]).view(-1, *[1] * (plain[key].dim() - 1))
        assert torch.allclose(scaled[key], 1 + factor * plain[key], atol=1e-6)
    assert float(plain["weight"].abs().max()) > 0  # std 2 * 1.5 * 1: really noise


def test_releases_reserved_and_drawn_up_front_equal_releases_one_at_a_time():
    """`reserve` + `draw_noise` (the span path) make the ledger decisions and the noise of
    K separate admit / add_scaled_noise / record rounds, stream for stream."""
    settings = DPSettings(clip=1.0, noise_multiplier=1.0)
    budget = {0: 2, 1: 5, 2: 0}  # releases each client can still afford
    ctx = SimpleNamespace(rows=torch.tensor([0, 1, 2]), phase="cotraining")

    def mechanism(log):
        def allowed(rows, rate, phase):
            return torch.tensor(
                [sum(r.clients.count(int(c)) for r in log) < budget[int(c)] for c in rows]
            )

        return DPMechanism(settings, NoiseStreams(4, [0, 1, 2]), log.append, allowed)

    steps, one_log, all_log = 3, [], []
    one, separate = mechanism(one_log), []
    for _ in range(steps):
        admitted = one.admit(ctx, 0.5)
        target = {"weight": torch.zeros(3, 2, 3), "bias": torch.zeros(3, 2)}
        one.add_scaled_noise(target, None)
        one.record(ctx, admitted, 0.5)
        separate.append((admitted, target))
    together = mechanism(all_log)
    reserved = together.reserve(ctx, 0.5, steps)
    bias, weight = torch.empty(3, steps, 2), torch.empty(3, steps, 2, 3)
    together.draw_noise([part for k in range(steps) for part in (bias[:, k], weight[:, k])])
    assert one_log == all_log and len(all_log) == steps
    for k, (admitted, target) in enumerate(separate):
        assert torch.equal(reserved[k], admitted)
        assert torch.allclose(weight[:, k] * settings.noise_std, target["weight"])
        assert torch.allclose(bias[:, k] * settings.noise_std, target["bias"])
    assert reserved.sum(0).tolist() == [2, 3, 0]


def test_ghost_clipping_matches_per_example_autograd():
    model = LinearSoftmax((5,), 3)
    gen = torch.Generator().manual_seed(1)
    params = {
        k: torch.stack([model.init(gen)[k] * 5 for _ in range(2)]) for k in ("weight", "bias")
    }
    x = torch.randn(2, 6, 5, generator=gen) * 3
    y = torch.randint(0, 3, (2, 6), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    sums, _ = clipped_gradient_sum(model, params, x, y, mask, clip=0.7)
    for c in range(2):
        expected = {k: torch.zeros_like(v[c]) for k, v in params.items()}
        for i in range(6):
            if not mask[c, i]:
                continue
            own = {k: v[c].clone().requires_grad_(True) for k, v in params.items()}
            loss = torch.nn.functional.cross_entropy(
                model.forward(own, x[c, i : i + 1]), y[c, i : i + 1]
            )
            g = dict(zip(own, torch.autograd.grad(loss, list(own.values()))))
            norm = torch.sqrt(sum(t.pow(2).sum() for t in g.values()))
            for k in g:
                expected[k] += g[k] * min(1.0, 0.7 / float(norm))
        for k in params:
            assert torch.allclose(sums[k][c], expected[k], atol=1e-5)


def test_replace_one_conversion_is_between_the_naive_and_group_bounds():
    rdp = RDPAccountant()
    history = [ReleaseSegment(noise_multiplier=1.2, sample_rate=0.1, steps=200)]
    add_remove = accounted_epsilon(rdp, history, 1e-5, "add-remove")
    replace_one = accounted_epsilon(
        rdp, history, 1e-5, "replace-one"
    )  # noise is doubled, counted twice
    assert 0 < replace_one < 2 * add_remove


class ReleaseRecorder:
    def __init__(self):
        self.releases = []

    @hookimpl
    def privacy_release(self, run, release):
        self.releases.append(release)


def test_private_run_reports_epsilon_and_every_release(small_config):
    recorder = ReleaseRecorder()
    pm = create_plugin_manager(autoload=False)
    result = run(
        small_config(method="local", epsilon=3.0, rounds=4),
        observers=[recorder],
        plugin_manager=pm,
        track=False,
    )
    summary = result.summary
    assert 0 < summary["epsilon"] <= 3.0 + 1e-9
    assert summary["accountant"] == "pld" and summary["epsilon_pld"] == pytest.approx(
        summary["epsilon"]
    )  # the default
    assert summary["epsilon_rdp"] >= summary["epsilon"]  # rdp, the cross-check, is looser
    assert summary["noise_multiplier"] > 0 and summary["neighbouring"] == "add-remove"
    # local: every client releases K=2 steps in each of 4 rounds
    steps = np.zeros(8)
    for release in recorder.releases:
        steps[list(release.clients)] += release.steps
    assert (steps == 8).all()
    metrics = result.outcome.reports[-1].metrics
    assert metrics["epsilon_max"] == pytest.approx(summary["epsilon"])


def test_budget_stops_a_clients_releases_and_logs_it(small_config):
    recorder = ReleaseRecorder()
    pm = create_plugin_manager(autoload=False)
    # sigma fixed and small, budget tiny: clients exhaust the budget mid-run
    config = small_config(
        method="local", epsilon=1.0, noise_multiplier=1.0, rounds=5, data_rate=0.3
    )
    result = run(config, observers=[recorder], plugin_manager=pm, track=False)
    summary = result.summary
    assert summary["clients_stopped"] == 8 and summary["budget_stops"]
    assert summary["epsilon"] <= 1.0
    steps = np.zeros(8)
    for release in recorder.releases:
        steps[list(release.clients)] += release.steps
    assert (steps < 10).all()  # fewer than the 5 x 2 planned steps
    budget = get_accountant(summary["accountant"], registry=Registry(pm))
    spent = accounted_epsilon(
        budget, [ReleaseSegment(1.0, 0.3, int(steps.max()) + 1)], summary["delta"], "add-remove"
    )
    assert spent > 1.0  # one more step would have exceeded the budget, under the run's accountant


def test_fedavg_accepts_epsilon(small_config):
    result = run(small_config(method="fedavg", epsilon=8.0, rounds=3, client_rate=0.5), track=False)
    assert 0 < result.summary["epsilon"] <= 8.0
