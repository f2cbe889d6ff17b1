"""p4bench.models.stacked: every client at once without vmap (the scatter-CNN), and ghost
clipping on it, against the per-client vmap path and F.unfold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from p4bench.engine.training import cross_entropy, distillation_loss, reference_loss_and_grad
from p4bench.models import ScatterCNN, stacked
from p4bench.privacy import clipping

SHAPES = [
    (243, 8, 8),
    (81, 2, 2),
    (81, 7, 7),
]  # CIFAR-10's scatter features (wide model), digits', MNIST's


def _problem(shape, clients=3, batch=5, seed=0):
    torch.manual_seed(seed)
    model = ScatterCNN(shape, 10)
    base = model.init(torch.Generator().manual_seed(seed))
    params = {
        k: v.expand(clients, *v.shape) + 0.05 * torch.randn(clients, *v.shape)
        for k, v in base.items()
    }
    x, y = torch.randn(clients, batch, *shape), torch.randint(0, 10, (clients, batch))
    mask = (torch.rand(clients, batch) < 0.7).float()
    mask[:, 0] = 1.0
    return model, params, x, y, mask


@pytest.mark.parametrize("shape", SHAPES)
def test_the_stacked_forward_is_every_clients_forward(shape):
    model, params, x, _, _ = _problem(shape)
    torch.testing.assert_close(
        model.stacked_forward(params, x), vmap(model.forward)(params, x), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("distill", [False, True])
def test_ghost_clipping_gives_the_per_example_clipped_sums(shape, distill):
    """Norms from Gram matrices, sums as one GEMM: the sums of explicitly clipped
    per-example gradients (the vmap path), with a clip that binds for some examples only."""
    model, params, x, y, mask = _problem(shape)
    loss, aux = (
        (distillation_loss(0.5), torch.randn(*y.shape, 10)) if distill else (cross_entropy, None)
    )
    expected, expected_losses = clipping._generic_clipped_sum(
        model, params, x, y, mask, 0.5, loss, aux
    )
    got, losses = stacked.clipped_gradient_sum(model, params, x, y, mask, 0.5, loss, aux)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)


def test_loss_and_gradients_equal_the_per_client_autograd_loop():
    model, params, x, y, mask = _problem((81, 7, 7))
    value, grads = stacked.stacked_loss_and_grad(model, params, x, y, mask, cross_entropy)
    ref_value, ref_grads = reference_loss_and_grad(model, params, x, y, mask)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-6)


def test_chunks_of_clients_change_nothing(monkeypatch):
    model, params, x, y, mask = _problem((243, 8, 8), clients=4)
    whole, _ = stacked.clipped_gradient_sum(model, params, x, y, mask, 0.5, cross_entropy)
    monkeypatch.setattr(stacked, "CHUNK_ELEMENTS", 1)  # one client per chunk
    assert stacked._chunks(model, x) == [slice(i, i + 1) for i in range(4)]
    chunked, _ = stacked.clipped_gradient_sum(model, params, x, y, mask, 0.5, cross_entropy)
    for key in whole:
        torch.testing.assert_close(chunked[key], whole[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        stacked.stacked_logits(model, params, x), model.stacked_forward(params, x)
    )


@pytest.mark.parametrize(("kernel", "stride", "padding"), [(3, 1, 1), (3, 2, 1), (2, 2, 0)])
def test_patch_rows_are_f_unfolds(kernel, stride, padding):
    h = torch.randn(4, 5, 7, 6)
    expected = F.unfold(h, kernel, padding=padding, stride=stride).transpose(1, 2)
    torch.testing.assert_close(
        stacked._patch_rows(h, kernel, stride, padding), expected, rtol=0, atol=0
    )


def test_padding_examples_contribute_nothing():
    model, params, x, y, mask = _problem((81, 2, 2))
    mask[1, 1:] = 0.0
    sums, _ = stacked.clipped_gradient_sum(model, params, x, y, mask, 0.5, cross_entropy)
    x2 = x.clone()
    x2[1, 1:] = torch.randn_like(x2[1, 1:]) * 10  # other values where the mask is 0
    again, _ = stacked.clipped_gradient_sum(model, params, x2, y, mask, 0.5, cross_entropy)
    for key in sums:
        torch.testing.assert_close(again[key][1], sums[key][1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(243, 8, 8), (81, 7, 7), (81, 2, 2)])
def test_first_layer_grams_kept_per_dataset_give_the_same_sums(shape):
    """The first layer's input Grams depend on the samples alone: computed once per data
    set and gathered per batch, they give the sums computed from the batch itself."""
    from p4bench.data import ClientTensors
    from p4bench.engine.training import gather_batch
    from p4bench.privacy.mechanism import input_statistics

    model, params, _, _, _ = _problem(shape)
    train = ClientTensors(
        torch.randn(3, 9, *shape), torch.randint(0, 10, (3, 9)), torch.full((3,), 9)
    )
    index = torch.stack([torch.randperm(9)[:5] for _ in range(3)])
    x, y, mask = gather_batch(train.x, index), gather_batch(train.y, index), torch.ones(3, 5)
    stats = input_statistics(model, train)
    if shape == (81, 2, 2):  # one output position: the norms need no Gram
        assert stats is None
        return
    assert stats is input_statistics(model, train) and stats.shape[:2] == (
        3,
        9,
    )  # kept on the data set
    expected, _ = stacked.clipped_gradient_sum(model, params, x, y, mask, 0.5, cross_entropy)
    got, _ = stacked.clipped_gradient_sum(
        model, params, x, y, mask, 0.5, cross_entropy, grams=gather_batch(stats, index)
    )
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7)


def test_row_subsets_select_the_data_sets_grams_instead_of_recomputing(monkeypatch):
    from p4bench.data import ClientTensors

    model, _, _, _, _ = _problem((81, 7, 7))
    train = ClientTensors(
        torch.randn(3, 6, 81, 7, 7), torch.zeros(3, 6, dtype=torch.long), torch.tensor([6, 4, 5])
    )
    whole = stacked.dataset_input_grams(model, train)
    calls = []
    monkeypatch.setattr(
        stacked, "input_grams", lambda *a: calls.append(a) or pytest.fail("recomputed")
    )
    subset = train.rows(torch.tensor([2, 1]))
    torch.testing.assert_close(
        stacked.dataset_input_grams(model, subset), whole[torch.tensor([2, 1]), :5], rtol=0, atol=0
    )
    assert not calls


@pytest.mark.parametrize("shape", [(243, 8, 8), (81, 2, 2)])
def test_one_replaced_record_moves_a_clipped_sum_by_at_most_two_clips(shape):
    """Replace-one sensitivity of the ghost-clipped sum, checked on two batches that differ
    in one record (features and label): the released sum moves by at most 2C in L2 norm,
    and the other clients' sums not at all."""
    model, params, x, y, mask = _problem(shape, clients=2, batch=6, seed=3)
    mask[:] = 1.0
    clip = 0.05  # small enough to bind for every example
    neighbour_x, neighbour_y = x.clone(), y.clone()
    neighbour_x[0, 2] = 50 * torch.randn_like(x[0, 2])
    neighbour_y[0, 2] = (y[0, 2] + 1) % 10
    sums, _ = stacked.clipped_gradient_sum(model, params, x, y, mask, clip, cross_entropy)
    moved, _ = stacked.clipped_gradient_sum(
        model, params, neighbour_x, neighbour_y, mask, clip, cross_entropy
    )
    change = torch.sqrt(sum(((moved[k][0] - sums[k][0]) ** 2).sum() for k in sums))
    assert 0 < float(change) <= 2 * clip * (1 + 1e-5)
    for key in sums:
        torch.testing.assert_close(moved[key][1], sums[key][1], rtol=0, atol=0)


def test_the_default_losses_equal_torchs_up_to_rounding():
    """`cross_entropy` and `log_softmax` are written as elementwise operations (torch's CPU
    kernel is slow for a few classes): values and gradients equal torch's, large logits included."""
    from p4bench.engine.training import log_softmax

    generator = torch.Generator().manual_seed(0)
    logits = (
        torch.randn(300, 10, generator=generator)
        * torch.tensor([1.0, 30.0, 300.0]).repeat(100)[:, None]
    )
    logits.requires_grad_(True)
    labels = torch.randint(0, 10, (300,), generator=generator)
    ours, theirs = cross_entropy(logits, labels), F.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(ours.sum(), logits)[0],
        torch.autograd.grad(theirs.sum(), logits)[0],
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(
        log_softmax(logits), F.log_softmax(logits, dim=-1), rtol=1e-6, atol=1e-5
    )
    assert torch.isfinite(cross_entropy(torch.tensor([[1e4, -1e4]]), torch.tensor([1]))).all()
