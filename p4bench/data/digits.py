"""scikit-learn's bundled `digits`: the offline default dataset (1,797 8x8 images, 10 classes)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from p4bench.data.base import ArrayDataset, Dataset


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """`sklearn.datasets.load_digits()`'s images (N, 8, 8) and targets, read from the CSV
    scikit-learn ships, as `load_digits` reads it, without importing scikit-learn (about
    1 s on a small machine, the largest start-up cost of a digits run). Falls back to
    `load_digits` where the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, mode="rt", encoding="utf-8") as handle:
                data = np.loadtxt(handle, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


class DigitsDataset(Dataset):
    """Handwritten digits bundled with scikit-learn (no download needed)."""

    name = "digits"
    description = "scikit-learn's bundled 8x8 digits, 10 classes, offline"

    def load(self, data_dir: Path) -> ArrayDataset:
        images, target = _bundled_digits()
        x = (images.astype(np.float32) / 16.0)[:, None, :, :]  # (N, 1, 8, 8) in [0, 1]
        y = target.astype(np.int64)
        # digits has no official split; a fixed 80/20 cut keeps the arrays deterministic.
        cut = int(0.8 * len(y))
        return ArrayDataset(
            self.name, x[:cut], y[:cut], x[cut:], y[cut:], tuple(str(c) for c in range(10))
        )
