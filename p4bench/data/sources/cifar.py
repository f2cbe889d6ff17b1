"""CIFAR-10 and CIFAR-100 from the official python-pickle batches (local files only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from p4bench.data.base import ArrayDataset, Dataset, PublicSource
from p4bench.data.sources.common import decode, key, load_array_pickle, missing_error
from p4bench.errors import DataError
from p4bench.options import Option, resolve_options

if TYPE_CHECKING:
    from p4bench.config import RunConfig

# ITU-R BT.601 luma weights of R, G, B (what PIL's "L" conversion uses).
LUMA_601 = (0.299, 0.587, 0.114)


def _images(data: object, path: Path) -> np.ndarray:
    """(N, 3072) uint8 rows (R, G, B planes of 32x32) -> (N, 3, 32, 32) uint8."""
    array = np.asarray(data)
    if array.ndim != 2 or array.shape[1] != 3 * 32 * 32 or array.dtype != np.uint8:
        raise DataError(
            f"{path}: expected uint8 image rows of 3072 bytes, found {array.dtype} {array.shape}"
        )
    return array.reshape(-1, 3, 32, 32)


def _scaled(images: np.ndarray) -> np.ndarray:
    """uint8 -> float32 in [0, 1] (converted once, after concatenation, to halve peak memory)."""
    return images.astype(np.float32) / np.float32(255.0)


def _luma(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, H, W) -> float32 greyscale (N, 1, H, W) in [0, 1]: Y = 0.299 R + 0.587 G
    + 0.114 B (ITU-R BT.601), unrounded; one channel at a time to bound peak memory."""
    gray = np.zeros((len(images), 1, *images.shape[2:]), dtype=np.float32)
    for channel, weight in enumerate(LUMA_601):
        gray[:, 0] += images[:, channel].astype(np.float32) * np.float32(weight / 255.0)
    return gray


def _labels(values: object, count: int, num_classes: int, path: Path) -> np.ndarray:
    labels = np.asarray(values, dtype=np.int64)
    if labels.shape != (count,):
        raise DataError(f"{path}: {labels.size} labels for {count} images")
    if count and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
    return labels


class _CifarBase(Dataset):
    folder: ClassVar[str]
    train_files: ClassVar[tuple[str, ...]]
    test_file: ClassVar[str]
    meta_file: ClassVar[str]
    label_key: ClassVar[str]
    names_key: ClassVar[str]
    archive: ClassVar[str]
    uses_run_config = True  # for option grayscale
    options = (
        Option(
            "grayscale",
            bool,
            False,
            "greyscale images 1x32x32: ITU-R BT.601 luma 0.299 R + 0.587 G + 0.114 B "
            "(Karras et al. train on greyscale CIFAR-10)",
        ),
    )

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, self.test_file, self.meta_file)

    def location(self, data_dir: Path) -> Path:
        return Path(data_dir) / self.folder

    def is_present(self, data_dir: Path) -> bool:
        return all((self.location(data_dir) / f).is_file() for f in self.files)

    def load(self, data_dir: Path, config: RunConfig | None = None) -> ArrayDataset:
        gray = (
            bool(resolve_options(self.options, config.options)["grayscale"])
            if config is not None
            else False
        )
        scaled = _luma if gray else _scaled
        folder = self.location(data_dir)
        missing = [f for f in self.files if not (folder / f).is_file()]
        if missing:
            raise missing_error(
                self.name, folder, missing, f"unpack {self.archive} into {Path(data_dir)}"
            )
        meta_path = folder / self.meta_file
        class_names = decode(key(load_array_pickle(meta_path), self.names_key, meta_path))
        parts = []
        for file_name in (*self.train_files, self.test_file):
            path = folder / file_name
            batch = load_array_pickle(path)
            x = _images(key(batch, "data", path), path)
            parts.append(
                (x, _labels(key(batch, self.label_key, path), len(x), len(class_names), path))
            )
        train, (x_test, y_test) = parts[:-1], parts[-1]
        x_train = scaled(np.concatenate([x for x, _ in train]))
        y_train = np.concatenate([y for _, y in train])
        return ArrayDataset(self.name, x_train, y_train, scaled(x_test), y_test, class_names)


class Cifar10Dataset(_CifarBase):
    """CIFAR-10: 50,000 + 10,000 32x32 RGB images, 10 classes."""

    name = "cifar10"
    description = "CIFAR-10 (python batches in cifar-10-batches-py/), 10 classes, 3x32x32"
    folder = "cifar-10-batches-py"
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_file = "test_batch"
    meta_file = "batches.meta"
    label_key = "labels"
    names_key = "label_names"
    archive = "cifar-10-python.tar.gz"

    def public_unlabeled(self, data_dir: Path, config: RunConfig | None = None) -> PublicSource:
        """CIFAR-100's 50,000 training images, labels dropped: the public data FedDF (Lin et
        al.) distilled CIFAR-10 models on; loaded with the run's options (`grayscale`)."""
        source = Cifar100Dataset()
        if not source.is_present(data_dir):
            raise DataError(
                f"the public unlabeled data of cifar10 is CIFAR-100 (as in FedDF), not found in "
                f"{source.location(data_dir)}: run `p4bench data download cifar100`, or use -o public_data=pool"
            )
        return PublicSource(
            "CIFAR-100 training images (50000 records, unlabeled)",
            lambda: source.load(data_dir, config).x_train,
        )


class Cifar100Dataset(_CifarBase):
    """CIFAR-100 with its 100 fine labels."""

    name = "cifar100"
    description = "CIFAR-100 fine labels (python files in cifar-100-python/), 100 classes, 3x32x32"
    folder = "cifar-100-python"
    train_files = ("train",)
    test_file = "test"
    meta_file = "meta"
    label_key = "fine_labels"
    names_key = "fine_label_names"
    archive = "cifar-100-python.tar.gz"
