"""P4's fused co-training step for linear models equals the generic autograd path."""

from __future__ import annotations

import pytest
import torch

from p4bench.data import ClientTensors
from p4bench.engine.training import distillation_loss
from p4bench.run.runner import run
from p4bench_p4 import fused
from p4bench_p4.fused import mutual_distillation_gradients, size_buckets
from p4bench_p4.span import span_is_cheaper


@pytest.mark.parametrize("alpha, beta", [(0.5, 0.5), (0.0, 1.0), (0.3, 0.0)])
def test_closed_form_gradients_equal_autograd_of_the_distillation_losses(alpha, beta):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 2, 7, generator=gen) * 3
    y = torch.randint(0, 7, (3, 5), generator=gen)
    grads, losses = mutual_distillation_gradients(logits, y, alpha, beta)
    proxy = logits[:, :, 0].reshape(15, 7).clone().requires_grad_(True)
    private = logits[:, :, 1].reshape(15, 7).clone().requires_grad_(True)
    proxy_losses = distillation_loss(alpha)(proxy, y.reshape(-1), private.detach())
    private_losses = distillation_loss(beta)(private, y.reshape(-1), proxy.detach())
    (proxy_grad,) = torch.autograd.grad(proxy_losses.sum(), proxy)
    (private_grad,) = torch.autograd.grad(private_losses.sum(), private)
    assert torch.allclose(grads[:, :, 0].reshape(15, 7), proxy_grad, atol=1e-6)
    assert torch.allclose(grads[:, :, 1].reshape(15, 7), private_grad, atol=1e-6)
    assert torch.allclose(losses.reshape(-1), proxy_losses.detach(), atol=1e-6)


def test_size_buckets_cover_every_client_once_with_bounded_padding():
    counts = torch.tensor([30, 5, 17, 16, 0, 31, 9, 24, 23])
    order, buckets = size_buckets(counts, width=31, granularity=8)
    assert sorted(order.tolist()) == list(range(9))
    assert counts[order].tolist() == sorted(counts.tolist())
    assert buckets[0][0] == 0 and buckets[-1][1] == 9
    for (_, end, _), (start, _, _) in zip(buckets, buckets[1:]):
        assert end == start  # contiguous, no overlap
    for start, end, width in buckets:
        sizes = counts[order[start:end]]
        assert int(sizes.max()) <= width <= 31 and width - int(sizes.min().clamp_min(1)) < 8


@pytest.mark.parametrize("mode", ["buckets", "span"])
@pytest.mark.parametrize(
    "privacy",
    [
        {"no_dp": True},  # non-private: fixed-size batches
        {"epsilon": 20.0},  # calibrated DP: Poisson batches of varying size
        # fixed noise: budgets run out during co-training (under rdp's looser replace-one bound)
        {"epsilon": 12.0, "noise_multiplier": 0.8, "accountant": "rdp"},
        {
            "epsilon": 20.0,
            "client_rate": 0.5,
        },  # partial participation: a subset of rows every round
    ],
    ids=["no-dp", "dp", "budget", "partial"],
)
def test_fused_step_matches_the_generic_path(small_config, monkeypatch, privacy, mode):
    seen = []

    def spy(counts, width, granularity=fused.BUCKET):
        order, buckets = size_buckets(counts, width, granularity)
        seen.append(len(buckets))
        return order, buckets

    monkeypatch.setattr(fused, "size_buckets", spy)
    options = {"group_size": 3}
    config = small_config(
        method="p4", clients=12, rounds=3, local_steps=4, data_rate=0.6, options=options, **privacy
    )
    # the span path's exact per-step draws (its default basis sampler has the same
    # distribution, tested in test_p4_span.py, but other numbers)
    fast = run(
        config.replace(options={**options, "fused": mode, "span_noise": "streams"}), track=False
    )
    generic = run(config.replace(options={**options, "fused": False}), track=False)
    if "epsilon" in privacy and mode == "buckets":
        assert max(seen) > 1  # Poisson batch sizes spread over several buckets
    if mode == "span":
        assert not seen  # the bucketed path never ran
    if "noise_multiplier" in privacy:
        stopped = fast.outcome.final_state["stopped"]

        def stops(result):  # the bucketed path reports its rows in batch-size order
            return [
                (stop["phase"], stop["round"], sorted(stop["clients"]))
                for stop in result.summary["budget_stops"]
            ]

        assert 0 < int(stopped.sum()) and stops(fast) == stops(generic)
        assert {phase for phase, _, _ in stops(fast)} == {"cotraining"}
    for name in ("proxy", "private"):
        for key, value in fast.outcome.final_state[name].items():
            assert torch.allclose(value, generic.outcome.final_state[name][key], atol=2e-5), (
                name,
                key,
            )
    assert torch.equal(fast.outcome.final_state["stopped"], generic.outcome.final_state["stopped"])


def test_gram_matrices_are_computed_once_and_shared_with_row_subsets():
    gen = torch.Generator().manual_seed(2)
    data = ClientTensors(
        torch.randn(4, 6, 2, 3, generator=gen),
        torch.zeros(4, 6, dtype=torch.long),
        torch.tensor([6, 3, 5, 2]),
    )
    flat = data.x.flatten(start_dim=2)
    assert torch.allclose(data.gram(), flat @ flat.transpose(1, 2), atol=1e-5)
    subset = data.rows(torch.tensor([3, 1]))  # trimmed to width 3
    assert torch.equal(subset.gram(), data.gram()[[3, 1], :3, :3])
    assert subset.gram().untyped_storage().data_ptr() != data.gram().untyped_storage().data_ptr()
    fresh = ClientTensors(data.x, data.y, data.n).rows(torch.tensor([0]))
    fresh.gram()
    assert "_gram" in fresh.__dict__["_parent"][0].__dict__  # computed on the parent, once


def test_span_path_is_chosen_where_it_needs_fewer_flops():
    # the benchmark's CIFAR-shaped workload: K = 5, s = 0.5, n = 160, d = 15552
    assert span_is_cheaper(160, 15552, 10, 5, 0.5, private=True)
    # digits: few features per sample, n^2 terms dominate; small s: few rows per step
    assert not span_is_cheaper(110, 64, 10, 4, 0.6, private=True)
    assert not span_is_cheaper(160, 15552, 10, 5, 0.1, private=True)


def test_a_subset_of_all_rows_shares_the_parents_cache_without_a_copy():
    data = ClientTensors(
        torch.randn(3, 4, 5), torch.zeros(3, 4, dtype=torch.long), torch.tensor([4, 4, 2])
    )
    whole = data.rows(torch.arange(3))
    assert whole.orthonormal_basis()[0] is data.orthonormal_basis()[0]
    part = data.rows(torch.tensor([2, 0]))
    assert torch.equal(part.orthonormal_basis()[0], data.orthonormal_basis()[0][[2, 0]])
