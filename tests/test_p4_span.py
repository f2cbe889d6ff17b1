"""P4's span path: the basis-noise sampler against the per-step noise draws it replaces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from p4bench.data import ClientTensors
from p4bench.data.federated import orthonormal_bases
from p4bench.privacy.mechanism import DPMechanism, DPSettings, NoiseStreams
from p4bench.rng import ClientRng, node_keys
from p4bench_p4.span import SpanCotraining

CLASSES = 3


def _clients(
    count: int, width: int = 4, dim: int = 6, seed: int = 0
) -> tuple[ClientTensors, dict, dict]:
    """`count` copies of one client (same samples and models): independent samples of its round."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(width, dim, generator=gen) * 2
    y = torch.randint(0, CLASSES, (width,), generator=gen)
    train = ClientTensors(
        x.expand(count, width, dim).clone(),
        y.expand(count, width).clone(),
        torch.full((count,), width),
    )
    proxy = {
        "weight": torch.randn(CLASSES, dim, generator=gen).expand(count, CLASSES, dim).clone(),
        "bias": torch.zeros(count, CLASSES),
    }
    private = {
        "weight": torch.randn(CLASSES, dim, generator=gen).expand(count, CLASSES, dim).clone(),
        "bias": torch.zeros(count, CLASSES),
    }
    return train, proxy, private


def _round(noise: str, train, proxy, private, sigma: float, noise_seed: int, steps: int = 3):
    count = len(train.n)
    rows = torch.arange(count)
    dp = DPMechanism(
        DPSettings(clip=1.0, noise_multiplier=sigma),
        NoiseStreams(noise_seed, rows.tolist()),
        lambda release: None,
        lambda ids, rate, phase: torch.ones(len(ids), dtype=torch.bool),
    )
    ctx = SimpleNamespace(
        rows=rows,
        dp=dp,
        rng=ClientRng(node_keys(5, rows, 0)),
        config=SimpleNamespace(data_rate=0.5),
        phase="cotraining",
    )
    step = SpanCotraining(alpha=0.5, beta=0.5, lr=1.0, data_rate=0.5, noise=noise)
    new_proxy, new_private, _, taken = step.run(proxy, private, train, ctx, steps)
    assert torch.equal(taken, torch.full((count,), float(steps)))
    return torch.cat(
        [
            new_proxy["weight"].flatten(1),
            new_proxy["bias"],
            new_private["weight"].flatten(1),
            new_private["bias"],
        ],
        dim=1,
    )


def test_basis_factorisation_is_orthonormal_even_for_padded_rank_deficient_data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 7, generator=gen)
    x[0, 3:] = 0  # padding rows
    x[1, 4] = x[1, 0] * 2  # a dependent sample
    basis, coords = orthonormal_bases(x, chunk=1)
    assert basis.shape == (2, 5, 7) and coords.shape == (2, 5, 5)
    assert torch.allclose(basis @ basis.transpose(1, 2), torch.eye(5).expand(2, 5, 5), atol=1e-5)
    assert torch.allclose(coords.transpose(1, 2) @ basis, x, atol=1e-5)


def test_basis_noise_without_noise_is_the_streams_path():
    """std 0: what is left is the Q/R algebra, which must reproduce the data-space path."""
    train, proxy, private = _clients(5)
    assert torch.allclose(
        _round("basis", train, proxy, private, 0.0, 1),
        _round("streams", train, proxy, private, 0.0, 1),
        atol=1e-5,
    )


@pytest.mark.parametrize("dim", [6, 3])  # d > n: noise outside the span; d < n: the basis spans R^d
def test_basis_noise_has_the_joint_distribution_of_per_step_draws(dim):
    """Means and covariances of everything a round produces (both models' weights and
    biases) agree between the basis sampler and K real per-step draws, over 4000
    independent clients; a wrong spread or a missing part outside the span would not."""
    train, proxy, private = _clients(4000, dim=dim, seed=2)
    basis = _round("basis", train, proxy, private, 0.7, 11)
    streams = _round("streams", train, proxy, private, 0.7, 12)
    scale = float(streams.var(dim=0).max())
    assert scale > 0.05  # the noise is large enough to matter
    assert float((basis.mean(0) - streams.mean(0)).abs().max()) < 0.1 * scale**0.5
    covariance = [torch.cov(sample.t()) for sample in (basis, streams)]
    assert float((covariance[0] - covariance[1]).abs().max()) < 0.15 * scale
    # the check has power: dropping the noise outside the span, or summing scales instead
    # of variances, moves the covariance well past the tolerance
    if dim > 4:
        proxy_weights = slice(0, CLASSES * dim)
        assert float(streams[:, proxy_weights].var(0).min()) > 0.3 * scale


def test_the_span_path_gives_way_to_the_buckets_where_its_basis_would_not_fit(monkeypatch):
    """On an accelerator a stored basis (d < n: as large as the samples) and its QR must fit
    beside the data: otherwise `auto` takes the bucketed path (same math), never an
    out-of-memory. With n <= d the basis is implicit: n x n tables per client."""
    import p4bench_p4.span as p4_method
    from p4bench.data import ClientTensors

    train = ClientTensors(
        torch.randn(3, 60, 40), torch.zeros(3, 60, dtype=torch.long), torch.full((3,), 60)
    )
    need = 2 * train.x.numel() * 4
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: (need, 10 * need))
    assert not p4_method.span_fits(train, basis=True)
    assert p4_method.span_fits(train, basis=False)  # the streams mode keeps no basis
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: (4 * need, 10 * need))
    assert p4_method.span_fits(train, basis=True)
    train.orthonormal_basis()
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: (0, 10 * need))
    assert p4_method.span_fits(train, basis=True)  # already built: nothing more to fit
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: None)  # the CPU
    assert p4_method.span_fits(ClientTensors(train.x, train.y, train.n), basis=True)
    # n <= d: the implicit basis needs its small tables only, not the samples' size again
    wide = ClientTensors(
        torch.randn(3, 6, 400), torch.zeros(3, 6, dtype=torch.long), torch.full((3,), 6)
    )
    tables = 6 * 8 * 3 * 6 * 6
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: (2 * tables, 10 * tables))
    assert 2 * tables < wide.x.numel() * 4 and p4_method.span_fits(wide, basis=True)
    monkeypatch.setattr(p4_method, "free_device_memory", lambda device: (tables // 2, 10 * tables))
    assert not p4_method.span_fits(wide, basis=True)
