"""The implicit orthonormal basis of the span path (`p4bench.privacy.span_factor`): Q = X^T R^-1
applied through R, its orthogonality where it is used, and the per-client fallback."""

from __future__ import annotations

import pytest
import torch

import p4bench.privacy.span_factor as span_factor_module
from p4bench.data import ClientTensors
from p4bench.privacy.span_factor import MAX_IMPLICIT_CONDITION, span_factors
from p4bench_p4.span import span_factor
from tests.test_p4_span import _clients, _round


def _conditioned(width: int, dim: int, condition: float, seed: int) -> torch.Tensor:
    """(width, dim) samples with singular values spread geometrically up to `condition`."""
    gen = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(width, width, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(dim, width, generator=gen, dtype=torch.float64))
    values = torch.logspace(
        0, -torch.log10(torch.tensor(condition)).item(), width, dtype=torch.float64
    )
    return (left * values * 40) @ right.t()


def _applied_basis(factor, x: torch.Tensor) -> torch.Tensor:
    """Q^T (C, n, d) as the span path applies it: R^-T in float64, then float32 with X."""
    identity = torch.eye(x.shape[1]).expand(x.shape[0], -1, -1)
    return torch.bmm(factor.from_span(identity.contiguous()), x.flatten(start_dim=2))


def test_implicit_basis_is_orthonormal_within_the_stated_tolerance_up_to_the_condition_limit():
    """Q^T Q = I (Q Q^T on the span for padded clients), computed the way the path applies Q:
    the float32 error grows like eps32 cond(X), so at the limit it stays under 1e-3."""
    x = torch.stack(
        [
            _conditioned(12, 80, c, seed)
            for seed, c in enumerate([1.0, 30.0, MAX_IMPLICIT_CONDITION / 2])
        ]
    ).float()
    x[1, 9:] = 0  # padding rows
    factor = span_factors(x, chunk=2)
    assert not bool(factor.explicit.any())
    q_t = _applied_basis(factor, x)
    gram = torch.bmm(q_t.double(), q_t.double().transpose(1, 2))
    expected = torch.diag_embed((x.flatten(start_dim=2).abs().sum(2) > 0).double())
    errors = (gram - expected).abs().amax(dim=(1, 2))
    assert float(errors.max()) < 1e-3
    assert float(errors[0]) < 1e-5  # a well-conditioned client is orthonormal to float32 rounding
    # X = coords^T Q^T, and the Gram matrix is X X^T
    flat = x.flatten(start_dim=2)
    assert torch.allclose(torch.bmm(factor.coords.transpose(1, 2), q_t), flat, atol=1e-3)
    assert torch.allclose(factor.gram, torch.bmm(flat, flat.transpose(1, 2)), rtol=1e-5, atol=1e-2)
    assert torch.allclose(factor.condition[:1].float(), torch.tensor([1.0]), rtol=1e-3)


def test_ill_conditioned_or_dependent_clients_keep_a_stored_basis():
    x = torch.stack(
        [
            _conditioned(8, 50, c, seed)
            for seed, c in enumerate([2.0, 20 * MAX_IMPLICIT_CONDITION, 2.0])
        ]
    ).float()
    x[2, 5] = 3 * x[2, 1]  # a dependent sample: R singular
    factor = span_factors(x, chunk=1)
    assert factor.explicit.tolist() == [False, True, True]
    assert factor.bases.shape == (2, 8, 50)
    q_t = _applied_basis(factor, x)  # the identity factor for the stored ones: their Q^T is `bases`
    q_t[factor.explicit] = factor.bases
    flat = x.flatten(start_dim=2)
    assert torch.allclose(torch.bmm(factor.coords.transpose(1, 2), q_t), flat, atol=1e-3)
    stored = factor.bases.double()
    assert torch.allclose(
        stored @ stored.transpose(1, 2),
        torch.eye(8, dtype=torch.float64).expand(2, 8, 8),
        atol=1e-5,
    )


def test_a_subset_of_clients_reads_the_whole_dataset_factor():
    x = torch.randn(4, 6, 30)
    x[0, 4:] = 0
    train = ClientTensors(x, torch.zeros(4, 6, dtype=torch.long), torch.tensor([4, 6, 6, 6]))
    whole = span_factor(train)
    part = train.rows(torch.tensor([2, 0]))
    assert span_factor(part).gram.shape == (2, 6, 6)
    assert torch.equal(span_factor(part).coords, whole.coords[[2, 0]])
    assert span_factor(train) is whole  # once per dataset


@pytest.mark.parametrize("stored", [False, True])
def test_without_noise_the_implicit_and_stored_bases_reproduce_the_data_space_path(
    monkeypatch, stored
):
    if stored:  # every client falls back to its Householder basis
        monkeypatch.setattr(span_factor_module, "MAX_IMPLICIT_CONDITION", 0.0)
    train, proxy, private = _clients(5, width=4, dim=9)
    assert torch.allclose(
        _round("basis", train, proxy, private, 0.0, 1),
        _round("streams", train, proxy, private, 0.0, 1),
        atol=1e-5,
    )
    assert bool(span_factor(train).explicit.all()) is stored


@pytest.mark.parametrize("stored", [False, True])
def test_the_noise_covariance_is_exact_through_either_basis(monkeypatch, stored):
    """The empirical mean and covariance of everything a round releases, over 4000
    independent clients, match K real per-step draws, through the implicit basis and
    through the stored fallback (padding rows included)."""
    if stored:
        monkeypatch.setattr(span_factor_module, "MAX_IMPLICIT_CONDITION", 0.0)
    train, proxy, private = _clients(4000, width=4, dim=6, seed=3)
    train.x[:, 3] = 0  # a padding row: one sample fewer than the width
    train = ClientTensors(train.x, train.y, torch.full((4000,), 3))
    implicit = _round("basis", train, proxy, private, 0.7, 21)
    streams = _round("streams", train, proxy, private, 0.7, 22)
    assert bool(span_factor(train).explicit.all()) is stored
    scale = float(streams.var(dim=0).max())
    assert scale > 0.05
    assert float((implicit.mean(0) - streams.mean(0)).abs().max()) < 0.1 * scale**0.5
    covariance = [torch.cov(sample.t()) for sample in (implicit, streams)]
    assert float((covariance[0] - covariance[1]).abs().max()) < 0.15 * scale


def test_the_implicit_and_stored_bases_give_the_same_numbers_for_the_same_draws(monkeypatch):
    """Independent samples: Q with R's diagonal positive is unique, so the same noise draws
    through the implicit basis and through a stored Householder one give the same round
    to float rounding (an exact check of the algebra, noise included)."""
    train, proxy, private = _clients(6, width=4, dim=9, seed=4)
    train.x.add_(
        torch.randn(train.x.shape, generator=torch.Generator().manual_seed(5))
    )  # distinct clients
    implicit = _round("basis", train, proxy, private, 0.7, 31)
    monkeypatch.setattr(span_factor_module, "MAX_IMPLICIT_CONDITION", 0.0)
    fresh = ClientTensors(train.x.clone(), train.y, train.n)  # no cached factor
    stored = _round("basis", fresh, proxy, private, 0.7, 31)
    assert bool(span_factor(fresh).explicit.all()) and not bool(span_factor(train).explicit.any())
    assert float(implicit.abs().max()) > 0.1
    assert torch.allclose(implicit, stored, atol=1e-4, rtol=1e-4)
