"""Shared readers for the on-disk formats: IDX (MNIST/EMNIST), array-only pickles (CIFAR)."""

from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p4bench.errors import DataError

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def missing_error(name: str, folder: Path, files: Sequence[str], source: str) -> DataError:
    """The one-line error for a dataset whose files are not where `load` looks."""
    return DataError(
        f"dataset '{name}' not found: expected {', '.join(files)} in {folder} ({source}); "
        f"run `p4bench data download {name}` or place the files there "
        f"(P4BENCH_DATA_DIR selects the data folder)"
    )


def find_idx(folder: Path, stem: str) -> Path | None:
    """`stem` or `stem.gz` in `folder`, whichever exists (uncompressed first)."""
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path, ndim: int | None = None) -> np.ndarray:
    """An IDX array (optionally gzip-compressed), checking its magic number and size."""
    try:
        raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read IDX file {path}: {exc}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    dims_count = raw[3]
    if ndim is not None and dims_count != ndim:
        raise DataError(f"{path}: expected an IDX file with {ndim} dimensions, found {dims_count}")
    header = 4 + 4 * dims_count
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{dims_count}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: IDX data has {len(raw) - header} bytes, the header {dims} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers of numpy arrays and nothing else.

    Dataset pickles come from the internet; refusing every other global keeps a
    tampered file from running code while it loads.
    """

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # protocol-2 pickles written by Python 3 encode bytes this way
    }
    # Array reconstructors, wherever the writing numpy version kept them.
    _NUMPY_INTERNAL = {
        ("multiarray", "_reconstruct"),
        ("multiarray", "scalar"),
        ("numeric", "_frombuffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        internal = (
            module.startswith("numpy.")
            and (module.rsplit(".", 1)[-1], name) in self._NUMPY_INTERNAL
        )
        if not internal and (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are allowed"
            )
        if module.startswith("numpy.core."):
            # numpy 2 renamed numpy.core to numpy._core; old pickles still name the former.
            try:
                return super().find_class("numpy._core." + module[len("numpy.core.") :], name)
            except (ImportError, AttributeError):
                pass
        return super().find_class(module, name)


def load_array_pickle(path: Path) -> dict[bytes | str, Any]:
    """A pickled dict of arrays/lists (Python 2 CIFAR batches: keys come back as bytes)."""
    try:
        with path.open("rb") as handle:
            data = _ArrayUnpickler(handle, encoding="bytes").load()
    except (
        OSError,
        EOFError,
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        ImportError,
        AttributeError,
    ) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a pickled dict, found {type(data).__name__}")
    return data


def key(data: dict[bytes | str, Any], name: str, path: Path) -> Any:
    """data[b'name'] (or data['name']) with a clear error when absent."""
    for candidate in (name.encode(), name):
        if candidate in data:
            return data[candidate]
    raise DataError(f"{path}: missing key '{name}'")


def decode(values: Sequence[Any]) -> tuple[str, ...]:
    return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in values)
