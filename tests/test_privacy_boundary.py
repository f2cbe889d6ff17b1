"""Finding 1 of the privacy review, as a counterexample: with the paper's distillation
teacher (the non-DP private model), one record z moves the proxy's clipped gradient
sum on a batch that does not contain z; with the certified defaults it cannot."""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits

from p4bench.config import RunConfig
from p4bench.engine.training import distillation_loss, logits_of
from p4bench.models import LinearSoftmax
from p4bench.privacy.mechanism import clipped_gradient_sum
from p4bench_baselines.proxyfl import ProxyFL
from p4bench_p4.method import P4

CLIP = 1.0


def _private_model(model, x, y, steps=40, lr=0.5):
    """A client's non-DP private model trained on (x, y), full batch, fixed start."""
    params = model.init(torch.Generator().manual_seed(0))
    for _ in range(steps):
        params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = torch.nn.functional.cross_entropy(model.forward(params, x), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        params = {k: v - lr * g for (k, v), g in zip(params.items(), grads)}
    return {k: v.detach().unsqueeze(0) for k, v in params.items()}


@pytest.fixture(scope="module")
def neighbours():
    """Two datasets differing in record z (index 0), the private model trained on
    each, and a batch of other records (z is not in it)."""
    digits = load_digits()
    x = torch.tensor(digits.data[:120] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:120])
    x2, y2 = x.clone(), y.clone()
    x2[0], y2[0] = (
        torch.tensor(digits.data[500] / 16.0, dtype=torch.float32),
        (y[0] + 5) % 10,
    )  # replace z
    model = LinearSoftmax((64,), 10)
    batch = torch.arange(1, 41)
    return (
        model,
        _private_model(model, x, y),
        _private_model(model, x2, y2),
        x[batch].unsqueeze(0),
        y[batch].unsqueeze(0),
    )


def _movement(model, proxy, teacher_of, loss, neighbours) -> float:
    """max over coordinates of |clipped sum on D - on D'| / C for the batch without z."""
    _, private_d, private_d2, xb, yb = neighbours
    mask = torch.ones(yb.shape)
    sums = []
    for private in (private_d, private_d2):
        teacher = teacher_of(private, xb)
        total, _ = clipped_gradient_sum(model, proxy, xb, yb, mask, CLIP, loss, teacher)
        sums.append(torch.cat([v.flatten() for v in total.values()]))
    return float((sums[0] - sums[1]).norm() / CLIP)


def _p4(teacher: str) -> P4:
    options = {"teacher": teacher, **({"alpha": 0.5} if teacher != "none" else {}), "fused": False}
    return P4(RunConfig(method="p4", clients=4, options=options), LinearSoftmax((64,), 10), 4)


@pytest.mark.parametrize(
    "teacher, moves", [("none", False), ("last-proxy", False), ("private", True)]
)
def test_p4_teacher_counterexample(neighbours, teacher, moves):
    model = neighbours[0]
    method = _p4(teacher)
    proxy = {k: v.unsqueeze(0) for k, v in model.init(torch.Generator().manual_seed(1)).items()}
    state = {"group_proxy": {k: v + 0.01 for k, v in proxy.items()}}  # the round's released proxy

    def teacher_of(private, xb):
        params = method._teacher(state, private)
        return None if params is None else logits_of(model, params, xb)

    moved = _movement(model, proxy, teacher_of, distillation_loss(method.alpha), neighbours)
    assert (moved > 0.05) if moves else moved == 0.0
    assert bool(method.uncertified_steps()) == moves


@pytest.mark.parametrize(
    "teacher, moves", [("none", False), ("last-proxy", False), ("private", True)]
)
def test_proxyfl_teacher_counterexample(neighbours, teacher, moves):
    model = neighbours[0]
    method = ProxyFL(RunConfig(method="proxyfl", clients=4, options={"teacher": teacher}), model, 4)
    proxy = {k: v.unsqueeze(0) for k, v in model.init(torch.Generator().manual_seed(1)).items()}
    released = {k: v + 0.01 for k, v in proxy.items()}

    def teacher_of(private, xb):
        return method.teacher_logits(model, logits_of(model, private, xb), released, xb)

    moved = _movement(model, proxy, teacher_of, method.proxy_loss, neighbours)
    assert (moved > 0.05) if moves else moved == 0.0
    assert bool(method.uncertified_steps()) == moves


def test_feature_normalisation_counterexample():
    """Finding 3: with per-client statistics one record changes every other record's
    features; per-sample normalisation (the default) leaves them exactly as they were."""
    import numpy as np

    from p4bench.data.features import normalize_federated, normalize_samples
    from p4bench.data.federated import ClientTensors, FederatedData

    gen = torch.Generator().manual_seed(3)
    x = torch.rand(1, 10, 81, 2, 2, generator=gen) * 5
    y, n = torch.zeros(1, 10, dtype=torch.long), torch.tensor([10])
    x2 = x.clone()
    x2[0, 0] = torch.rand(81, 2, 2, generator=gen) * 50  # record z replaced
    others = slice(1, 10)

    def features(data_x, normalise):
        tensors = ClientTensors(data_x, y, n)
        data = FederatedData(
            tensors, tensors, torch.zeros(1, dtype=torch.bool), 10, (81, 2, 2), (), (np.arange(10),)
        )
        return normalise(data).train.x[0, others]

    assert torch.equal(features(x, normalize_samples), features(x2, normalize_samples))
    assert not torch.allclose(
        features(x, normalize_federated), features(x2, normalize_federated), atol=1e-3
    )
