"""A dataset generated from a fixed seed: no files, no network."""

import numpy as np

from p4bench.api import ArrayDataset, Dataset

CLASSES, FEATURES, PER_CLASS = 10, 16, 120


class Blobs(Dataset):
    """Ten Gaussian classes in 16 dimensions, 100 training and 20 test records per class.

    `load(data_dir)` is the whole contract: float32 features and int64 labels for both
    splits, and the class names. A dataset with files reads them under `data_dir` and
    says where (`location`) and whether they are there (`is_present`).
    """

    name = "blobs"
    description = "ten Gaussian classes in 16 dimensions from a fixed seed (example plugin)"

    def load(self, data_dir):
        rng = np.random.default_rng(20261127)
        centres = rng.normal(0.0, 2.0, size=(CLASSES, FEATURES))
        labels = np.repeat(np.arange(CLASSES), PER_CLASS)
        features = (centres[labels] + rng.normal(size=(len(labels), FEATURES))).astype(np.float32)
        order = rng.permutation(len(labels))
        features, labels = features[order], labels[order].astype(np.int64)
        cut = len(labels) * 5 // 6
        return ArrayDataset(
            self.name,
            features[:cut],
            labels[:cut],
            features[cut:],
            labels[cut:],
            tuple(f"blob {c}" for c in range(CLASSES)),
        )
