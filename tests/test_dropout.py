"""Hashed dropout (`p4bench.models.dropout`) in Karras et al.'s Table I CNN: training forwards drop
about p of the units, the same ones on every path that computes gradients, and evaluation
sees the identity."""

from __future__ import annotations

import torch

from p4bench.engine.training import batched_loss_and_grad, reference_loss_and_grad
from p4bench.models.dropout import hashed_dropout, training
from p4bench.privacy.clipping import clipped_gradient_sum
from p4bench_p2p_fl.models import GrayCNN


def _setup(clients: int = 2, batch: int = 5):
    model = GrayCNN((1, 10, 10), 10)
    generator = torch.Generator().manual_seed(0)
    inits = [model.init(torch.Generator().manual_seed(i)) for i in range(clients)]
    params = {k: torch.stack([p[k] for p in inits]) for k in inits[0]}
    x = torch.rand(clients, batch, 1, 10, 10, generator=generator)
    y = torch.randint(0, 10, (clients, batch), generator=generator)
    return model, params, x, y, torch.ones(clients, batch)


def test_dropout_rate_and_scale_in_training_identity_outside():
    h = torch.ones(400, 50)
    x = torch.rand(400, 8, generator=torch.Generator().manual_seed(1))
    salt = torch.randn(10, generator=torch.Generator().manual_seed(2))
    assert torch.equal(hashed_dropout(h, x, salt, 0.5, layer=1), h)  # not training: the identity
    with training():
        dropped = hashed_dropout(h, x, salt, 0.25, layer=1)
        again = hashed_dropout(h, x, salt, 0.25, layer=1)
        other_layer = hashed_dropout(h, x, salt, 0.25, layer=2)
        other_salt = hashed_dropout(h, x, salt + 1e-3, 0.25, layer=1)
    kept = dropped != 0
    assert abs(float(kept.double().mean()) - 0.75) < 0.01  # 20,000 units: 5 standard errors
    assert torch.allclose(dropped[kept], torch.full_like(dropped[kept], 1 / 0.75))
    assert torch.equal(dropped, again)  # a function of the example, the parameters and the layer
    assert not torch.equal(dropped, other_layer) and not torch.equal(dropped, other_salt)
    # a unit's mask depends on its own example alone: the same rows in any batching
    with training():
        alone = hashed_dropout(h[3:4], x[3:4], salt, 0.25, layer=1)
    assert torch.equal(alone[0], dropped[3])


def test_every_gradient_path_drops_the_same_units():
    model, params, x, y, weight = _setup()
    loss_b, grads_b = batched_loss_and_grad(model, params, x, y, weight)
    loss_r, grads_r = reference_loss_and_grad(model, params, x, y, weight)
    torch.testing.assert_close(loss_b, loss_r)
    for key in grads_b:
        torch.testing.assert_close(grads_b[key], grads_r[key], rtol=1e-4, atol=1e-6)
    # clipped at a huge C the per-example path's sums are the plain sums of the same gradients
    sums, _ = clipped_gradient_sum(model, params, x, y, weight, clip=1e9)
    for key in grads_b:
        torch.testing.assert_close(
            sums[key] / weight.sum(1).view(-1, *[1] * (sums[key].dim() - 1)),
            grads_b[key],
            rtol=1e-4,
            atol=1e-6,
        )

    # and dropout is on in them: the gradients differ from a dropout-free model's
    class NoDropout(GrayCNN):
        dropout = (0.0, 0.0)

    _, plain = batched_loss_and_grad(NoDropout((1, 10, 10), 10), params, x, y, weight)
    assert not torch.allclose(plain["fc1.weight"], grads_b["fc1.weight"])


def test_evaluation_forward_has_no_dropout():
    model, params, x, _, _ = _setup()
    single = {k: v[0] for k, v in params.items()}
    first = model.forward(single, x[0])
    assert torch.equal(first, model.forward(single, x[0]))
    with training():
        assert not torch.equal(first, model.forward(single, x[0]))
