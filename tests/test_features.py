"""ScatterNet features, their cache, and per-client normalization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import p4bench.data.features as features
from p4bench.data.features import (
    FeatureCache,
    client_channel_stats,
    normalize_client_tensors,
    normalize_federated,
    scatter_dataset,
    scatter_features,
    scatter_output_shape,
    scatter_transform,
)
from p4bench.data.federated import ClientTensors, build_federated_data


def test_kymatio_2d_frontend_works_with_installed_scipy():
    import scipy
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    # kymatio.torch would also import the 3-D frontend, which needs scipy.special.sph_harm
    # (gone in SciPy 1.17); p4bench imports only the 2-D module.
    out = ScatteringTorch2D(J=2, shape=(8, 8), L=8)(torch.rand(2, 1, 8, 8))
    assert out.shape == (2, 1, 81, 2, 2), scipy.__version__


@pytest.mark.parametrize(
    "shape, expected",
    [((1, 28, 28), (81, 7, 7)), ((3, 32, 32), (243, 8, 8)), ((1, 8, 8), (81, 2, 2))],
)
def test_scatter_shapes(shape, expected):
    assert scatter_output_shape(shape) == expected
    x = np.random.default_rng(0).random((3, *shape), dtype=np.float32)
    out = scatter_transform(x, progress=False, batch_size=2)
    assert out.shape == (3, *expected) and out.dtype == np.float32
    # Channel c*81 + k of the flattened output is kymatio's (c, k) map.
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    raw = ScatteringTorch2D(J=2, shape=shape[1:], L=8)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, raw.reshape(3, *expected), rtol=1e-5, atol=1e-6)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    original = features.scatter_transform

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(features, "scatter_transform", counting)
    return calls


def test_cache_hit_then_corrupt_and_stale_entries_are_rebuilt(tmp_path, counted):
    x = np.random.default_rng(1).random((5, 1, 28, 28), dtype=np.float32)
    cache = FeatureCache(tmp_path)
    first = scatter_features(x, cache=cache, progress=False)
    assert len(counted) == 1
    second = scatter_features(x, cache=cache, progress=False)
    assert len(counted) == 1  # served from disk
    np.testing.assert_array_equal(first, second)
    [array_path] = tmp_path.glob("*.npy")
    [meta_path] = tmp_path.glob("*.json")
    meta = json.loads(meta_path.read_text())
    assert meta["params"]["J"] == 2 and meta["params"]["L"] == 8 and meta["shape"] == [5, 81, 7, 7]

    array_path.write_bytes(b"not an npy file")  # unreadable
    np.testing.assert_array_equal(scatter_features(x, cache=cache, progress=False), first)
    assert len(counted) == 2

    blob = bytearray(array_path.read_bytes())  # one flipped byte: loads, but the checksum differs
    blob[-7] ^= 0xFF
    array_path.write_bytes(bytes(blob))
    np.testing.assert_array_equal(scatter_features(x, cache=cache, progress=False), first)
    assert len(counted) == 3

    meta = json.loads(meta_path.read_text())  # stale: recorded for other content
    meta["content_hash"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    scatter_features(x, cache=cache, progress=False)
    assert len(counted) == 4
    scatter_features(x, cache=cache, progress=False)
    assert len(counted) == 4

    scatter_features(x + 1, cache=cache, progress=False)  # other content: another entry
    assert len(counted) == 5 and len(list(tmp_path.glob("*.npy"))) == 2


def test_default_cache_dir_comes_from_env(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path / "c"))
    x = np.zeros((2, 1, 8, 8), np.float32)
    scatter_features(x, progress=False)
    assert list((tmp_path / "c" / "features").glob("*.npy"))


def padded(xs: list[np.ndarray]) -> ClientTensors:
    ys = [np.zeros(len(x), np.int64) for x in xs]
    return ClientTensors.from_lists(xs, ys, xs[0].shape[1:])


def test_client_channel_stats_use_only_valid_samples():
    rng = np.random.default_rng(0)
    xs = [
        rng.normal(3, 2, (7, 4, 2, 2)).astype(np.float32),
        rng.normal(-1, 0.5, (3, 4, 2, 2)).astype(np.float32),
    ]
    tensors = padded(xs)
    assert tensors.x.shape[1] == 7  # client 1 is padded with zeros
    mean, std = client_channel_stats(tensors.x, tensors.n)
    for c, x in enumerate(xs):
        np.testing.assert_allclose(mean[c], x.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(std[c], x.std(axis=(0, 2, 3)), rtol=1e-4)
    train, test = normalize_client_tensors(tensors, padded([x[:2] for x in xs]))
    valid = train.x[0, :7]
    np.testing.assert_allclose(valid.mean(dim=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(valid.std(dim=(0, 2, 3), unbiased=False), 1, atol=1e-3)
    assert torch.all(train.x[1, 3:] == 0)  # padding untouched
    # The test split is normalized with the client's training statistics.
    expected = (torch.from_numpy(xs[1][:2]) - mean[1].reshape(4, 1, 1)) / (
        std[1].reshape(4, 1, 1) + 1e-5
    )
    torch.testing.assert_close(test.x[1, :2], expected)


def test_flat_features_and_empty_clients():
    tensors = ClientTensors(
        torch.randn(2, 4, 3), torch.zeros(2, 4, dtype=torch.int64), torch.tensor([4, 0])
    )
    mean, std = client_channel_stats(tensors.x, tensors.n)
    assert mean.shape == (2, 3) and torch.all(mean[1] == 0) and torch.all(std[1] == 1)
    normalized, _ = normalize_client_tensors(tensors)
    assert torch.isfinite(normalized.x).all() and torch.all(normalized.x[1] == 0)


@pytest.fixture(scope="module")
def digits_scatter(tmp_path_factory):
    from p4bench.data.digits import DigitsDataset

    folder = tmp_path_factory.mktemp("digits")
    return scatter_dataset(DigitsDataset().load(folder), cache=FeatureCache(folder), progress=False)


def test_scatter_dataset_and_federated_normalization(digits_scatter):
    data = digits_scatter
    assert data.feature_shape == (81, 2, 2) and len(data.y_train) == 1437
    rng = np.random.default_rng(0)
    partition = np.array_split(rng.permutation(len(data.pooled_labels())), 5)
    federated = normalize_federated(build_federated_data(data, partition, 0.2, rng))
    train = federated.train
    for c in range(5):
        valid = train.x[c, : int(train.n[c])]
        np.testing.assert_allclose(valid.mean(dim=(0, 2, 3)), 0, atol=1e-4)


def test_scatter_dataset_needs_images():
    from p4bench.data.base import ArrayDataset
    from p4bench.errors import IncompatibleError

    flat = ArrayDataset(
        "flat",
        np.zeros((2, 5), np.float32),
        np.zeros(2, np.int64),
        np.zeros((1, 5), np.float32),
        np.zeros(1, np.int64),
        ("a",),
    )
    with pytest.raises(IncompatibleError, match="flat"):
        scatter_dataset(flat, use_cache=False)


def test_centralized_linear_on_digits_scatter_features_reaches_90_percent(digits_scatter):
    """Sanity check of the features: a non-private linear softmax on pooled features."""
    data = digits_scatter
    x_train, x_test = (
        torch.from_numpy(data.x_train).flatten(1),
        torch.from_numpy(data.x_test).flatten(1),
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-5
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    y_train, y_test = torch.from_numpy(data.y_train), torch.from_numpy(data.y_test)
    torch.manual_seed(0)
    model = torch.nn.Linear(x_train.shape[1], 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-4)
    for _ in range(300):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x_train), y_train).backward()
        optimizer.step()
    accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
    print(f"digits ScatterNet + linear test accuracy: {accuracy:.4f}")
    assert accuracy >= 0.90
