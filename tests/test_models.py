"""Registered models: shapes, vmap over stacked client parameters, one batched grad step."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from p4bench.engine.training import batched_loss_and_grad, reference_loss_and_grad
from p4bench.errors import IncompatibleError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.models import LinearSoftmax, ScatterCNN, SmallCNN

CASES = [
    (ScatterCNN, (243, 8, 8), 10),  # CIFAR-10 ScatterNet features
    (ScatterCNN, (81, 7, 7), 47),  # EMNIST / MNIST ScatterNet features
    (ScatterCNN, (81, 2, 2), 10),  # digits ScatterNet features
    (SmallCNN, (3, 32, 32), 10),
    (SmallCNN, (1, 28, 28), 62),
    (SmallCNN, (1, 8, 8), 10),
    (LinearSoftmax, (81, 7, 7), 10),
]


def stacked(model, clients: int):
    per_client = [model.init(torch.Generator().manual_seed(i)) for i in range(clients)]
    return per_client, {k: torch.stack([p[k] for p in per_client]) for k in per_client[0]}


@pytest.mark.parametrize("cls, shape, classes", CASES)
def test_forward_and_vmap_match(cls, shape, classes):
    model = cls(shape, classes)
    per_client, params = stacked(model, 3)
    assert all(v.dtype == torch.float32 for v in per_client[0].values())
    x = torch.randn(3, 4, *shape, generator=torch.Generator().manual_seed(9))
    assert model.forward(per_client[0], x[0]).shape == (4, classes)
    batched = vmap(model.forward)(params, x)
    reference = torch.stack([model.forward(per_client[c], x[c]) for c in range(3)])
    torch.testing.assert_close(batched, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls, shape, classes", CASES[:1] + CASES[3:4])
def test_one_batched_grad_step(cls, shape, classes):
    model = cls(shape, classes)
    _, params = stacked(model, 3)
    x = torch.randn(3, 5, *shape, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, classes, (3, 5), generator=torch.Generator().manual_seed(2))
    weight = torch.ones(3, 5)
    weight[2, 3:] = 0  # padding
    loss, grads = batched_loss_and_grad(model, params, x, y, weight)
    ref_loss, ref_grads = reference_loss_and_grad(model, params, x, y, weight)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for name in params:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-5)
    stepped = {k: params[k] - 0.5 * grads[k] for k in params}
    new_loss, _ = batched_loss_and_grad(model, stepped, x, y, weight)
    assert torch.isfinite(new_loss).all() and (new_loss < loss).all()


def test_init_is_deterministic_from_the_generator():
    model = ScatterCNN((81, 7, 7), 10)
    a = model.init(torch.Generator().manual_seed(5))
    b = model.init(torch.Generator().manual_seed(5))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tramer_boneh_sizes():
    # Their CIFAR-10 ScatterNet+CNN has ~187K parameters, the MNIST one ~33K.
    cifar = ScatterCNN((243, 8, 8), 10)
    mnist = ScatterCNN((81, 7, 7), 10)
    assert cifar.num_parameters(cifar.init(torch.Generator())) == 187_210
    assert mnist.num_parameters(mnist.init(torch.Generator())) == 33_066


def test_models_are_registered_and_reject_flat_features():
    registry = Registry(create_plugin_manager(autoload=False))
    assert {"linear", "scatter-cnn", "cnn"} <= set(registry.names("model"))
    with pytest.raises(IncompatibleError, match="channels"):
        ScatterCNN((60,), 10)
    with pytest.raises(IncompatibleError, match="image"):
        SmallCNN((60,), 10)
