"""Batched Shapley values of PDSL's candidate models (p4bench_pdsl.shapley)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from p4bench.engine.state import unvectorize, vectorize
from p4bench.models import LinearSoftmax
from p4bench_pdsl.shapley import (
    coalition_game,
    coalition_values,
    exact_shapley,
    minmax_shares,
    monte_carlo_shapley,
)

LR = 2.0


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images / 16.0, dtype=torch.float32)[:, None]  # (N, 1, 8, 8)
    return x, torch.tensor(bunch.target, dtype=torch.int64)


def make_game(digits, present, seed=0):
    """A PDSL round on digits: A agents with their own random linear models; slot j of
    agent a holds the gradient of a's model on 40 examples of player j (the last player
    of each agent sends a noisy gradient); absent slots hold junk that must not be used."""
    x_all, y_all = digits
    present = torch.as_tensor(present, dtype=torch.bool)
    num_agents, slots = present.shape
    model = LinearSoftmax((1, 8, 8), 10)
    gen = torch.Generator().manual_seed(seed)
    params = [model.init(gen) for _ in range(num_agents)]
    stacked = {k: torch.stack([p[k] for p in params]) for k in params[0]}
    x = vectorize(stacked)
    q_x, q_y = x_all[-300:], y_all[-300:]

    def loss(p, xs, ys):
        return F.cross_entropy(model.forward(p, xs), ys)

    g = torch.full((num_agents, slots, x.shape[1]), 1e3)  # junk in absent slots
    start = torch.randint(0, 1400, (num_agents, slots), generator=gen)
    for a, j in itertools.product(range(num_agents), range(slots)):
        if present[a, j]:
            rows = slice(int(start[a, j]), int(start[a, j]) + 40)
            one = {k: v[a] for k, v in stacked.items()}
            g[a, j] = vectorize(
                {k: v[None] for k, v in grad(loss)(one, x_all[rows], y_all[rows]).items()}
            )[0]
    last = present.long().cumsum(1).argmax(1)  # the last present slot of each agent
    g[torch.arange(num_agents), last] += 0.5 * torch.randn(num_agents, x.shape[1], generator=gen)
    return model, stacked, x, g, present, q_x, q_y


def naive_values(model, like, x, g, masks, lr, q_x, q_y):
    out = torch.zeros(masks.shape[:2], dtype=torch.float64)
    for a, s in itertools.product(range(masks.shape[0]), range(masks.shape[1])):
        members = masks[a, s]
        if members.any():
            flat = x[a] - lr * g[a, members].mean(dim=0)
            params = {k: v[0] for k, v in unvectorize(flat[None], like).items()}
            out[a, s] = (model.forward(params, q_x).argmax(dim=1) == q_y).double().mean()
    return out


def permutation_average(values_fn, present_row):
    """Brute force: the mean marginal contribution over all orders of one agent's players."""
    players = torch.nonzero(present_row).flatten().tolist()
    phi = torch.zeros(len(present_row), dtype=torch.float64)
    orders = list(itertools.permutations(players))
    masks = torch.zeros(1, len(orders) * (len(players) + 1), len(present_row), dtype=torch.bool)
    for o, order in enumerate(orders):
        for t in range(len(players) + 1):
            masks[0, o * (len(players) + 1) + t, list(order[:t])] = True
    values = values_fn(masks)[0].reshape(len(orders), len(players) + 1)
    for o, order in enumerate(orders):
        for t, player in enumerate(order):
            phi[player] += (values[o, t + 1] - values[o, t]) / len(orders)
    return phi


# --- the batched game ----------------------------------------------------------------

PRESENT = [[1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0]]  # n = 4, 5, 3 with holes


def test_batched_coalition_values_equal_a_per_coalition_evaluation(digits):
    model, like, x, g, present, q_x, q_y = make_game(digits, PRESENT)
    gen = torch.Generator().manual_seed(1)
    masks = (torch.rand(3, 10, 6, generator=gen) < 0.5) & present[:, None, :]
    masks[:, 0] = False  # empty coalitions
    masks[:, 1] = masks[:, 2]  # duplicates
    expected = naive_values(model, like, x, g, masks, LR, q_x, q_y)
    for chunk in (1, 4, 128):  # chunks that split agents and ones that span them
        got = coalition_values(model, like, x, g, masks, LR, q_x, q_y, chunk=chunk)
        assert got.dtype == torch.float64 and got.shape == (3, 10)
        torch.testing.assert_close(got, expected)
    assert (expected[:, 0] == 0).all() and len(expected.unique()) > 3


def test_monte_carlo_converges_to_exact_on_a_4_player_neighbourhood(digits):
    model, like, x, g, present, q_x, q_y = make_game(digits, [[1, 1, 1, 1]] * 2, seed=3)
    game = coalition_game(model, like, x, g, LR, q_x, q_y)
    exact = exact_shapley(game, present)
    torch.testing.assert_close(
        exact[0], permutation_average(lambda m: game(m.expand(2, -1, -1))[:1], present[0])
    )
    assert (exact.amax(1) - exact.amin(1) > 0.02).all()  # a non-trivial game
    torch.testing.assert_close(
        exact.sum(1), game(present[:, None, :])[:, 0]
    )  # efficiency, v(empty) = 0
    estimate = monte_carlo_shapley(game, present, 2000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(estimate, exact, atol=0.015, rtol=0)


def test_single_permutation_estimate_is_one_order_of_the_players(digits):
    model, like, x, g, present, q_x, q_y = make_game(digits, [[1, 1, 1, 1]], seed=3)
    game = coalition_game(model, like, x, g, LR, q_x, q_y)
    candidates = []
    for order in itertools.permutations(range(4)):
        masks = torch.zeros(1, 5, 4, dtype=torch.bool)
        for t in range(5):
            masks[0, t, list(order[:t])] = True
        values = game(masks)[0]
        phi = torch.zeros(4, dtype=torch.float64)
        phi[list(order)] = values[1:] - values[:-1]
        candidates.append(phi)
    candidates_t = torch.stack(candidates)
    seen = set()
    for seed in range(30):
        estimate = monte_carlo_shapley(game, present, 1, torch.Generator().manual_seed(seed))[0]
        match = torch.nonzero(torch.isclose(candidates_t, estimate).all(1)).flatten()
        assert len(match) >= 1 and estimate.sum() == pytest.approx(
            float(game(present[:, None])[0, 0])
        )
        seen.add(int(match[0]))
    assert len(seen) > 5  # the orders do vary with the generator
    # unbiased: the mean over all orders is the exact value
    torch.testing.assert_close(candidates_t.mean(0), exact_shapley(game, present)[0])


def test_padding_gives_the_values_of_each_agent_alone(digits):
    model, like, x, g, present, q_x, q_y = make_game(digits, PRESENT)
    batched = exact_shapley(coalition_game(model, like, x, g, LR, q_x, q_y), present)
    for a in range(3):
        keep = present[a]
        alone = exact_shapley(
            coalition_game(model, like, x[a : a + 1], g[a : a + 1, keep], LR, q_x, q_y),
            torch.ones(1, int(keep.sum()), dtype=torch.bool),
        )
        torch.testing.assert_close(batched[a, keep], alone[0])
        assert (batched[a, ~keep] == 0).all()
    mc = monte_carlo_shapley(
        coalition_game(model, like, x, g, LR, q_x, q_y),
        present,
        3,
        torch.Generator().manual_seed(0),
    )
    assert (mc[~present] == 0).all()
    full = coalition_values(model, like, x, g, present[:, None, :], LR, q_x, q_y)[:, 0]
    torch.testing.assert_close(mc.sum(1), full)  # efficiency of every agent despite the padding
    # With per-agent keys the orders, hence the estimates, do not depend on the batch.
    keys = torch.rand(3, 5, 6, generator=torch.Generator().manual_seed(4))
    batched = monte_carlo_shapley(
        coalition_game(model, like, x, g, LR, q_x, q_y), present, 5, keys=keys
    )
    for a in range(3):
        keep = present[a]
        alone = monte_carlo_shapley(
            coalition_game(model, like, x[a : a + 1], g[a : a + 1, keep], LR, q_x, q_y),
            keep[None, keep],
            5,
            keys=keys[a : a + 1, :, keep],
        )
        torch.testing.assert_close(batched[a, keep], alone[0])


# --- synthetic games -----------------------------------------------------------------


def table_game(num_agents, slots, seed, empty_value=0.0):
    """v(S) = a random number per (agent, coalition), v(empty) = empty_value."""
    table = torch.rand(
        num_agents, 2**slots, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    table[:, 0] = empty_value
    bits = 2 ** torch.arange(slots)

    def values(masks):
        return table.gather(1, (masks.long() * bits).sum(-1))

    return values


def test_additive_game_gives_the_individual_values():
    weights = torch.tensor([[0.3, -0.1, 0.7, 0.2], [1.0, 2.0, 0.0, 5.0]], dtype=torch.float64)
    present = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)

    def additive(masks):
        return (masks * weights[:, None, :]).sum(-1)

    expected = weights * present
    torch.testing.assert_close(exact_shapley(additive, present), expected)
    for r in (1, 7):
        torch.testing.assert_close(
            monte_carlo_shapley(additive, present, r, torch.Generator().manual_seed(r)), expected
        )


def test_symmetric_game_gives_equal_values():
    present = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.bool)

    def by_size(masks):
        return masks.sum(-1).double() ** 2

    n = present.sum(1, keepdim=True).double()
    expected = torch.where(present, n**2 / n, torch.zeros(()).double())
    torch.testing.assert_close(exact_shapley(by_size, present), expected)
    # a finite sample of orders is not symmetric (the gain depends on the position), only close
    estimate = monte_carlo_shapley(by_size, present, 4000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(estimate, expected, atol=0.25, rtol=0)


@pytest.mark.parametrize("empty_value", [0.0, 0.4])
def test_efficiency_and_brute_force_on_random_games(empty_value):
    present = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 0, 1], [0, 0, 0, 1, 0]], dtype=torch.bool
    )
    game = table_game(4, 5, seed=2, empty_value=empty_value)
    grand = game(present[:, None, :])[:, 0] - empty_value
    exact = exact_shapley(game, present)
    torch.testing.assert_close(exact.sum(1), grand)
    for a in range(4):
        torch.testing.assert_close(
            exact[a],
            permutation_average(lambda m, a=a: game(m.expand(4, -1, -1))[a : a + 1], present[a]),
        )
    for seed in range(5):  # every single-order estimate is efficient
        one = monte_carlo_shapley(game, present, 1, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(one.sum(1), grand)


def test_degenerate_inputs():
    game = table_game(2, 3, seed=0)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert (exact_shapley(game, none) == 0).all()
    assert (monte_carlo_shapley(game, none, 2, torch.Generator()) == 0).all()
    with pytest.raises(ValueError, match="max_players"):
        exact_shapley(game, torch.ones(1, 3, dtype=torch.bool), max_players=2)
    with pytest.raises(ValueError, match="exactly one"):
        monte_carlo_shapley(game, torch.ones(1, 3, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="keys must be"):
        monte_carlo_shapley(game, torch.ones(1, 3, dtype=torch.bool), 2, keys=torch.rand(1, 3, 3))
    with pytest.raises(ValueError, match="R must be"):
        monte_carlo_shapley(game, torch.ones(1, 3, dtype=torch.bool), 0, torch.Generator())


# --- min-max shares ------------------------------------------------------------------


def test_minmax_shares_normalise_over_present_players():
    phi = torch.tensor([[0.1, 0.3, 0.2, 9.0], [0.5, -0.5, 0.0, 0.0]], dtype=torch.float64)
    present = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    phi_hat, shares, fallback = minmax_shares(phi, present)
    torch.testing.assert_close(
        phi_hat, torch.tensor([[0.0, 1.0, 0.5, 0.0], [1.0, 0.0, 0.5, 0.5]], dtype=torch.float64)
    )
    torch.testing.assert_close(shares.sum(1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(
        shares[0], torch.tensor([0.0, 2 / 3, 1 / 3, 0.0], dtype=torch.float64)
    )
    assert not fallback.any()


def test_minmax_falls_back_to_uniform_when_all_values_are_equal():
    third = 1 / 3
    phi = torch.tensor(
        [[0.2, 0.2, 0.2, -7.0], [third, 1 - 2 * third, third, third], [0.9, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    present = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    phi_hat, shares, fallback = minmax_shares(phi, present)
    assert fallback.tolist() == [True, True, True]  # equal, equal up to rounding, a single player
    n = present.sum(1, keepdim=True).double()
    torch.testing.assert_close(shares, present / n)
    assert torch.isfinite(phi_hat).all() and (phi_hat[~present] == 0).all()
    assert math.isclose(float(shares[0].sum()), 1.0) and np.isfinite(shares.numpy()).all()


def test_vmap_forward_over_models_shares_q(digits):
    """The batched forward used by coalition_values: in_dims=(0, None) equals a loop."""
    model, like, x, _, _, q_x, _ = make_game(digits, [[1, 1]] * 3)
    params = unvectorize(x, like)
    batched = vmap(model.forward, in_dims=(0, None))(params, q_x)
    for a in range(3):
        torch.testing.assert_close(
            batched[a], model.forward({k: v[a] for k, v in params.items()}, q_x)
        )


class _SameForwardModel(LinearSoftmax):
    """The linear model with its forward overridden: coalition_values must not assume
    linearity for it (a plugin's model is evaluated coalition by coalition)."""

    def forward(self, params, x):
        return super().forward(params, x)


def test_the_linear_shortcut_equals_the_per_coalition_forward(digits):
    from p4bench_pdsl.shapley import linear_in_parameters

    model, like, x, g, present, q_x, q_y = make_game(digits, PRESENT, seed=5)
    generic = _SameForwardModel((1, 8, 8), 10)
    assert linear_in_parameters(model) and not linear_in_parameters(generic)
    masks = (torch.rand(3, 40, 6, generator=torch.Generator().manual_seed(2)) < 0.5) & present[
        :, None, :
    ]
    shortcut = coalition_values(model, like, x, g, masks, LR, q_x, q_y, chunk=7)
    torch.testing.assert_close(
        shortcut, coalition_values(generic, like, x, g, masks, LR, q_x, q_y, chunk=7)
    )
    # per-agent validation sets (pdsl-local-val)
    q_n = torch.tensor([300, 120, 0])
    local_x, local_y = q_x.expand(3, *q_x.shape).clone(), q_y.expand(3, -1).clone()
    torch.testing.assert_close(
        coalition_values(model, like, x, g, masks, LR, local_x, local_y, q_n=q_n, chunk=5),
        coalition_values(generic, like, x, g, masks, LR, local_x, local_y, q_n=q_n, chunk=5),
    )
