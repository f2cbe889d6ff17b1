"""LEAF's FEMNIST (62 classes) with its natural partition by writer."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

from p4bench.data.base import ArrayDataset, Dataset
from p4bench.data.sources.common import missing_error
from p4bench.errors import DataError

LEAF_FEMNIST_CLASSES: tuple[str, ...] = tuple(
    string.digits + string.ascii_uppercase + string.ascii_lowercase
)
_PIXELS = 28 * 28


def _read_leaf_json(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(user, x (n, 784) float32, y (n,) int64) for every user of one LEAF json file."""
    try:
        with path.open("rb") as handle:
            data = json.load(handle)
        users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path} is not a LEAF json file ({type(exc).__name__}: {exc})") from None
    if len(users) != len(counts):
        raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    out = []
    for user, count in zip(users, counts):
        try:
            record = user_data[user]
            x = np.asarray(record["x"], dtype=np.float32).reshape(-1, _PIXELS)
            y = np.asarray(record["y"], dtype=np.int64).reshape(-1)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"{path}: bad record for user {user!r} ({type(exc).__name__}: {exc})"
            ) from None
        if len(x) != len(y) or len(y) != count:
            raise DataError(
                f"{path}: user {user!r} has {len(x)} images, {len(y)} labels, num_samples {count}"
            )
        out.append((str(user), x, y))
    return out


class LeafFemnistDataset(Dataset):
    """LEAF FEMNIST: handwritten characters of ~3,500 writers, 62 classes, with writer ids.

    Pixels are inverted from LEAF's white background (1.0) to ink = 1, background = 0,
    the MNIST/EMNIST convention, so every 28x28 dataset looks alike to the models.
    """

    name = "leaf-femnist"
    description = (
        "LEAF FEMNIST (json in leaf-femnist/{train,test}/), 62 classes, 1x28x28, writer ids"
    )
    folder = "leaf-femnist"

    def location(self, data_dir: Path) -> Path:
        return Path(data_dir) / self.folder

    def _files(self, data_dir: Path, split: str) -> list[Path]:
        return sorted((self.location(data_dir) / split).glob("*.json"))

    def is_present(self, data_dir: Path) -> bool:
        return bool(self._files(data_dir, "train")) and bool(self._files(data_dir, "test"))

    def load(self, data_dir: Path) -> ArrayDataset:
        folder = self.location(data_dir)
        if not self.is_present(data_dir):
            raise missing_error(
                self.name,
                folder,
                ["train/*.json", "test/*.json"],
                "LEAF's data/femnist/data/{train,test} from its preprocess.sh",
            )
        # One file at a time: LEAF json holds floats as text, so parsing all at once
        # would need many times the memory of the final arrays. Writer ids number the
        # users in order of first appearance (train files first, sorted by name).
        writer_ids: dict[str, int] = {}
        arrays = []
        for split in ("train", "test"):
            xs, ys, ws = [], [], []
            for path in self._files(data_dir, split):
                for user, x, y in _read_leaf_json(path):
                    xs.append(x)
                    ys.append(y)
                    ws.append(
                        np.full(len(y), writer_ids.setdefault(user, len(writer_ids)), np.int64)
                    )
            x = np.concatenate(xs) if xs else np.zeros((0, _PIXELS), np.float32)
            del xs
            y = np.concatenate(ys) if ys else np.zeros(0, np.int64)
            if len(y) and (y.min() < 0 or y.max() >= len(LEAF_FEMNIST_CLASSES)):
                raise DataError(
                    f"{folder / split}: labels outside 0..{len(LEAF_FEMNIST_CLASSES) - 1}"
                )
            np.subtract(np.float32(1.0), x, out=x)
            arrays.append(
                (x.reshape(-1, 1, 28, 28), y, np.concatenate(ws) if ws else np.zeros(0, np.int64))
            )
        (x_tr, y_tr, w_tr), (x_te, y_te, w_te) = arrays
        return ArrayDataset(
            self.name,
            x_tr,
            y_tr,
            x_te,
            y_te,
            LEAF_FEMNIST_CLASSES,
            writers_train=w_tr,
            writers_test=w_te,
        )
