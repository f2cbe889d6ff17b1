"""PDSL's fast paths on the linear model (issue 49): the closed-form cross-gradients
(`p4bench_pdsl.cross_linear`) against `cross_gradients`' batched autograd, and the
Monte-Carlo prefix scan (`p4bench_pdsl.shapley_scan`) against the generic path that values
the prefixes' masks (`coalition_values`), on the same draws."""

from __future__ import annotations

import itertools
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from p4bench.data import ClientTensors
from p4bench.engine.state import vectorize
from p4bench.engine.training import batched_loss_and_grad, reference_loss_and_grad
from p4bench.models import LinearSoftmax
from p4bench.privacy.mechanism import DPSettings
from p4bench.rng import client_rng
from p4bench_baselines.cross_gradients import cross_gradients
from p4bench_pdsl.cross_linear import pdsl_cross_gradients, takes_linear_path
from p4bench_pdsl.shapley import CoalitionGame, coalition_game, monte_carlo_shapley

# agent 0 misses slots 2 and 4, agent 2 has one player: padded neighbourhoods as on a sparse graph
PRESENT = torch.tensor(
    [
        [True, True, False, True, False],
        [True, True, True, True, True],
        [False, False, True, False, False],
        [True, False, True, True, True],
    ]
)


class _Capture:
    """A DP mechanism that records the noise scale asked for and adds none."""

    def __init__(self) -> None:
        self.settings = DPSettings(0.5, 2.0, "add-remove")
        self.scales: list[torch.Tensor] = []

    def reserve(self, ctx, rate, steps):
        return torch.ones(steps, len(ctx.rows), dtype=torch.bool)

    def add_scaled_noise(self, targets, scale):
        self.scales.append(scale.clone())


def _setting(dp=None, gradient=batched_loss_and_grad, seed=0):
    count, slots = PRESENT.shape
    model = LinearSoftmax((2, 3), 4)
    gen = torch.Generator().manual_seed(seed)
    inits = [model.init(gen) for _ in range(slots)]
    like = {k: torch.stack([p[k] for p in inits])[:count] for k in inits[0]}
    neighbours = vectorize({k: torch.stack([p[k] for p in inits]) for k in inits[0]})
    models = neighbours.unsqueeze(0).repeat(count, 1, 1)
    models[~PRESENT] = float("nan")  # what an absent slot holds must never be read
    sizes = torch.tensor([9, 12, 5, 12])
    train = ClientTensors(
        torch.randn(count, 12, 2, 3, generator=gen),
        torch.randint(0, 4, (count, 12), generator=gen),
        sizes,
    )
    ctx = SimpleNamespace(
        dp=dp,
        rng=client_rng(seed, torch.arange(count), 0, False),
        config=SimpleNamespace(data_rate=0.6),
        loss_and_grad=partial(gradient, model),
        model=model,
        rows=torch.arange(count),
        phase="train",
        train=None,
    )
    return ctx, models, like, train


@pytest.mark.parametrize("private", [False, True])
def test_closed_form_cross_gradients_equal_the_batched_autograd(private):
    fast_dp, slow_dp = (_Capture(), _Capture()) if private else (None, None)
    ctx, models, like, train = _setting(fast_dp)
    assert takes_linear_path(ctx, "batch")
    fast, fast_loss, fast_released = pdsl_cross_gradients(
        ctx, models, like, PRESENT, train, "batch"
    )
    ctx, models, like, train = _setting(slow_dp)  # the same streams again: the same batches
    slow, slow_loss, slow_released = cross_gradients(
        ctx, models.nan_to_num(0.0), like, PRESENT, train, "batch"
    )
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_loss, slow_loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(fast_released, slow_released)
    assert bool((fast[~PRESENT] == 0).all()) and bool(fast[PRESENT].abs().sum(1).gt(0).all())
    if private:  # the same release: clipped to C, noise scale by each agent's degree
        assert float(fast.norm(dim=2).max()) <= 0.5 + 1e-5
        torch.testing.assert_close(fast_dp.scales[0], slow_dp.scales[0])


def test_other_models_gradients_and_per_example_clipping_keep_cross_gradients():
    ctx, models, like, train = _setting(gradient=reference_loss_and_grad)
    assert not takes_linear_path(ctx, "batch")  # a reference runtime's per-client autograd
    ctx, *_ = _setting(_Capture())
    assert takes_linear_path(ctx, "batch") and not takes_linear_path(ctx, "per-example")
    ctx.loss_and_grad = partial(batched_loss_and_grad, ctx.model, loss=lambda *a: None)
    assert not takes_linear_path(ctx, "batch")  # another loss

    class Shifted(LinearSoftmax):  # a subclass may change the forward
        pass

    ctx, *_ = _setting()
    ctx.model = Shifted((2, 3), 4)
    ctx.loss_and_grad = partial(batched_loss_and_grad, ctx.model)
    assert not takes_linear_path(ctx, "batch")
    ctx, models, like, train = _setting(gradient=reference_loss_and_grad)
    models = models.nan_to_num(0.0)
    got = pdsl_cross_gradients(ctx, models, like, PRESENT, train, "batch")
    ctx, *_ = _setting(gradient=reference_loss_and_grad)
    want = cross_gradients(ctx, models, like, PRESENT, train, "batch")
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # handed over unchanged


@pytest.fixture(scope="module")
def game_inputs():
    """Four agents' linear models and candidate gradients on a digits-like problem (random
    features with a planted linear rule), a shared Q and per-agent padded validation sets."""
    gen = torch.Generator().manual_seed(3)
    count, slots = PRESENT.shape
    model = LinearSoftmax((16,), 5)
    inits = [model.init(gen) for _ in range(count)]
    like = {k: torch.stack([p[k] for p in inits]) for k in inits[0]}
    x = vectorize(like)
    g = 0.3 * torch.randn(count, slots, x.shape[1], generator=gen)
    g[~PRESENT] = 1e3  # junk in absent slots
    rule = torch.randn(16, 5, generator=gen)
    q_x = torch.randn(300, 16, generator=gen)
    q_y = (q_x @ rule).argmax(dim=1)
    own_x = torch.randn(count, 40, 16, generator=gen)
    own_y = (own_x @ rule).argmax(dim=2)
    q_n = torch.tensor([40, 25, 0, 7])  # agent 2 holds no validation record
    return model, like, x, g, q_x, q_y, own_x, own_y, q_n


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_prefix_scan_equals_valuing_the_prefix_masks(game_inputs, local, seed):
    model, like, x, g, q_x, q_y, own_x, own_y, q_n = game_inputs
    for lr in (0.5, 4.0):  # a large step leaves agents with different accuracies per coalition
        if local:
            game = coalition_game(model, like, x, g, lr, own_x, own_y, q_n=q_n)
        else:
            game = coalition_game(model, like, x, g, lr, q_x, q_y)
        keys = torch.rand(
            len(PRESENT), 7, PRESENT.shape[1], generator=torch.Generator().manual_seed(seed)
        )
        scanned = monte_carlo_shapley(game, PRESENT, 7, keys=keys)
        masked = monte_carlo_shapley(partial(CoalitionGame.__call__, game), PRESENT, 7, keys=keys)
        # the same sums in the same order: equal, not merely close
        assert torch.equal(scanned, masked)
        assert bool((scanned[~PRESENT] == 0).all())
        if local:
            assert bool((scanned[2] == 0).all())  # no validation record: every coalition worth 0
        assert float(scanned[PRESENT].abs().sum()) > 0


def test_the_scan_values_each_prefix_as_its_own_coalition(game_inputs):
    """Every prefix value the scan returns equals its coalition valued on its own."""
    model, like, x, g, q_x, q_y, *_ = game_inputs
    game = coalition_game(model, like, x, g, 4.0, q_x, q_y)
    keys = torch.rand(len(PRESENT), 3, PRESENT.shape[1], generator=torch.Generator().manual_seed(5))
    order = keys.masked_fill(~PRESENT[:, None, :], 2.0).argsort(dim=2)
    players = PRESENT.sum(1)
    values = game.prefix_values(order, players)
    # a neighbourhood of three is cheaper through the masks' chained coalitions
    assert game.prefix_values(order, torch.full_like(players, 3)) is None
    assert values is not None and values.shape == (len(PRESENT), 3, int(players.max()) + 1)
    for a, r in itertools.product(range(len(PRESENT)), range(3)):
        for length in range(int(players[a]) + 1):
            mask = torch.zeros(1, 1, PRESENT.shape[1], dtype=torch.bool)
            mask[0, 0, order[a, r, :length]] = True
            alone = coalition_game(model, like, x[a : a + 1], g[a : a + 1], 4.0, q_x, q_y)(mask)
            assert float(values[a, r, length]) == pytest.approx(float(alone[0, 0]), abs=1.5 / 300)
        assert bool((values[a, r, int(players[a]) + 1 :] == 0).all())
