"""Handcrafted ScatterNet features (Oyallon & Mallat, as used by Tramer & Boneh) and
per-client normalization, with an on-disk cache.

An image of shape (C, H, W) becomes (81*C, H/4, W/4) for J=2, L=8: 81 scattering
channels per input channel (1 low-pass + J*L first order + L^2*J(J-1)/2 second order).
The transform has no trainable parameters and needs no data statistics, so computing
it once for the whole dataset leaks nothing; the per-channel normalization that
follows uses each client's own training samples only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.data.base import ArrayDataset
from p4bench.data.federated import ClientTensors, FederatedData
from p4bench.errors import IncompatibleError

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = [
    "SCATTER_J",
    "SCATTER_L",
    "scatter_output_shape",
    "scatter_transform",
    "scatter_features",
    "scatter_dataset",
    "content_hash",
    "FeatureCache",
    "client_channel_stats",
    "normalize_clients",
    "normalize_client_tensors",
    "normalize_federated",
]

SCATTER_J, SCATTER_L = 2, 8
_FORMAT_VERSION = 1  # bump when the cached bytes for the same parameters would change


def scatter_output_shape(
    input_shape: tuple[int, int, int], J: int = SCATTER_J, L: int = SCATTER_L
) -> tuple[int, int, int]:
    """(K, H/2^J, W/2^J) for an input (C, H, W); K = 81*C for J=2, L=8."""
    channels, height, width = input_shape
    per_channel = 1 + J * L + L * L * J * (J - 1) // 2
    return channels * per_channel, -(-height // 2**J), -(-width // 2**J)


@lru_cache(maxsize=8)
def _scattering(height: int, width: int, J: int, L: int, device: str) -> torch.nn.Module:
    # `kymatio.torch` also imports the 3-D frontend, which needs scipy.special.sph_harm
    # (removed in SciPy 1.17); the 2-D torch frontend module has no such import.
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    scattering: torch.nn.Module = ScatteringTorch2D(J=J, shape=(height, width), L=L).to(
        device
    )  # kymatio: untyped
    return scattering


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def scatter_transform(
    x: np.ndarray | torch.Tensor,
    *,
    J: int = SCATTER_J,
    L: int = SCATTER_L,
    batch_size: int = 512,
    device: str | None = None,
    progress: bool = True,
    description: str = "ScatterNet features",
) -> np.ndarray:
    """ScatterNet features of images x (N, C, H, W) as float32 (N, 81*C, H/4, W/4), in batches."""
    x = torch.as_tensor(
        np.asarray(x) if not isinstance(x, torch.Tensor) else x, dtype=torch.float32
    )
    if x.ndim != 4:
        raise ValueError(
            f"scatter_transform expects images (N, C, H, W), got shape {tuple(x.shape)}"
        )
    count, channels, height, width = x.shape
    out_shape = scatter_output_shape((channels, height, width), J, L)
    device = device or _default_device()
    scattering = _scattering(height, width, J, L, device)
    out = np.empty((count, *out_shape), dtype=np.float32)
    with _progress(progress) as bar, torch.no_grad():
        task = bar.add_task(description, total=count)
        for start in range(0, count, batch_size):
            batch = x[start : start + batch_size].to(device).contiguous()
            features = scattering(batch)  # (b, C, 81, h, w)
            out[start : start + len(batch)] = features.reshape(len(batch), *out_shape).cpu().numpy()
            bar.advance(task, len(batch))
    return out


def _progress(enabled: bool) -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )


def content_hash(x: np.ndarray) -> str:
    """SHA-256 of an array's dtype, shape and bytes (identifies a dataset's content)."""
    array = np.ascontiguousarray(x)
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


class FeatureCache:
    """Derived arrays on disk: `<label>-<key>.npy` plus a JSON sidecar that records the
    input's content hash, the parameters and the output's SHA-256.

    A cache entry is used only when the sidecar parses, its hash and parameters match
    the request, and the array loads with the recorded shape and checksum; anything
    else (stale, truncated, tampered) is recomputed and rewritten atomically.
    """

    def __init__(self, root: Path | None = None) -> None:
        from p4bench.data.paths import cache_dir

        self.root = Path(root) if root is not None else cache_dir() / "features"

    def paths(self, label: str, source_hash: str, params: dict[str, Any]) -> tuple[Path, Path]:
        key = hashlib.sha256(
            json.dumps([source_hash, params], sort_keys=True).encode()
        ).hexdigest()[:24]
        stem = f"{label}-{key}"
        return self.root / f"{stem}.npy", self.root / f"{stem}.json"

    def load(self, label: str, source_hash: str, params: dict[str, Any]) -> np.ndarray | None:
        """The cached array, or None when absent, stale or corrupt."""
        array_path, meta_path = self.paths(label, source_hash, params)
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("content_hash") != source_hash or meta.get("params") != _jsonable(params):
                return None
            array: np.ndarray = np.load(array_path, allow_pickle=False)
            if list(array.shape) != meta.get("shape") or array.dtype.str != meta.get("dtype"):
                return None
            if content_hash(array) != meta.get("output_hash"):
                return None
            return array
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def store(
        self, label: str, source_hash: str, params: dict[str, Any], array: np.ndarray
    ) -> None:
        """Write array and sidecar; the sidecar is written last and marks the entry complete."""
        array_path, meta_path = self.paths(label, source_hash, params)
        self.root.mkdir(parents=True, exist_ok=True)
        meta = {
            "content_hash": source_hash,
            "params": _jsonable(params),
            "shape": list(array.shape),
            "dtype": array.dtype.str,
            "output_hash": content_hash(array),
        }
        meta_path.unlink(missing_ok=True)
        _atomic_write(array_path, lambda handle: np.save(handle, array, allow_pickle=False))
        _atomic_write(
            meta_path,
            lambda handle: handle.write(json.dumps(meta, indent=2, sort_keys=True).encode()),
        )

    def get_or_compute(
        self,
        label: str,
        source_hash: str,
        params: dict[str, Any],
        compute: Callable[[], np.ndarray],
    ) -> np.ndarray:
        cached = self.load(label, source_hash, params)
        if cached is not None:
            return cached
        array = compute()
        try:
            self.store(label, source_hash, params, array)
        except OSError:
            pass  # a read-only or full disk only costs recomputation next time
        return array


def _jsonable(params: dict[str, Any]) -> Any:
    return json.loads(json.dumps(params, sort_keys=True))


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def scatter_features(
    x: np.ndarray,
    *,
    J: int = SCATTER_J,
    L: int = SCATTER_L,
    cache: FeatureCache | None = None,
    use_cache: bool = True,
    label: str = "scatter",
    batch_size: int = 512,
    device: str | None = None,
    progress: bool = True,
) -> np.ndarray:
    """ScatterNet features of images x (N, C, H, W), computed once per (content, J, L)
    and then read from the cache (default: $P4BENCH_CACHE_DIR/features)."""
    x = np.asarray(x, dtype=np.float32)

    def compute() -> np.ndarray:
        return scatter_transform(
            x, J=J, L=L, batch_size=batch_size, device=device, progress=progress
        )

    if not use_cache:
        return compute()
    params = {"transform": "scatter2d", "J": J, "L": L, "format": _FORMAT_VERSION}
    return (cache or FeatureCache()).get_or_compute(
        f"{label}-J{J}L{L}", content_hash(x), params, compute
    )


def scatter_dataset(dataset: ArrayDataset, **kwargs: Any) -> ArrayDataset:
    """The dataset with its images replaced by ScatterNet features (labels, writers kept).

    Keyword arguments go to `scatter_features` (cache, use_cache, device, progress...).
    """
    if len(dataset.feature_shape) != 3:
        raise IncompatibleError(
            f"ScatterNet features need images (C, H, W); dataset '{dataset.name}' "
            f"has features of shape {dataset.feature_shape}"
        )
    x, _ = dataset.pooled()
    features = scatter_features(x, label=kwargs.pop("label", dataset.name), **kwargs)
    cut = len(dataset.y_train)
    return dataclasses.replace(dataset, x_train=features[:cut], x_test=features[cut:])


def client_channel_stats(x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-client, per-channel mean and standard deviation over each client's valid samples.

    x: (clients, n_max, channels, *spatial) padded along axis 1; n: (clients,) counts.
    Statistics pool the samples and the spatial positions of each channel. Returns
    (mean, std), each (clients, channels); a client without samples gets mean 0, std 1.
    """
    mask = (torch.arange(x.shape[1], device=x.device) < n.to(x.device).unsqueeze(1)).to(x.dtype)
    weight = mask.reshape(*mask.shape, *([1] * (x.ndim - 2)))
    reduce = (1, *range(3, x.ndim))
    positions = float(np.prod(x.shape[3:], dtype=np.int64))
    count = (n.to(x.dtype) * positions).clamp_min(1.0).unsqueeze(1)
    mean = (x * weight).sum(dim=reduce) / count
    centred = (x - mean.reshape(*mean.shape[:2], *([1] * (x.ndim - 3))).unsqueeze(1)) * weight
    var = (centred**2).sum(dim=reduce) / count
    empty = (n == 0).to(x.device).unsqueeze(1)
    return torch.where(empty, 0.0, mean), torch.where(empty, 1.0, var.sqrt())


def normalize_clients(
    x: torch.Tensor, n: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """(x - mean) / (std + eps) per client and channel; padding rows stay zero."""
    shape = (*mean.shape[:1], 1, *mean.shape[1:], *([1] * (x.ndim - 3)))
    mask = (torch.arange(x.shape[1], device=x.device) < n.to(x.device).unsqueeze(1)).to(x.dtype)
    normalized = (x - mean.reshape(shape)) / (std.reshape(shape) + eps)
    return normalized * mask.reshape(*mask.shape, *([1] * (x.ndim - 2)))


def normalize_client_tensors(
    train: ClientTensors, test: ClientTensors | None = None
) -> tuple[ClientTensors, ClientTensors | None]:
    """Normalize each client's train and test samples with its own *training* statistics."""
    mean, std = client_channel_stats(train.x, train.n)
    new_train = ClientTensors(normalize_clients(train.x, train.n, mean, std), train.y, train.n)
    if test is None:
        return new_train, None
    return new_train, ClientTensors(normalize_clients(test.x, test.n, mean, std), test.y, test.n)


def normalize_federated(data: FederatedData) -> FederatedData:
    """`data` with every client's features normalized by its own training statistics."""
    train, test = normalize_client_tensors(data.train, data.test)
    assert test is not None  # data.test is given
    return dataclasses.replace(data, train=train, test=test)


def sample_group_norm(
    x: torch.Tensor, groups: int | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Per-sample group normalisation of feature maps (..., channels, *spatial): each
    sample's channels are split into `groups` consecutive groups, and each group is
    standardised with that sample's own mean and std over its channels and positions.

    A function of each record alone, so it costs no privacy (Tramer & Boneh 2021 use it
    on ScatterNet features for DP training). Default groups: 27 where the channel count
    allows it (their choice for J=2 scattering of colour images), else the largest
    divisor of the channel count below 27. Zero (padding) samples stay zero.
    """
    channels = x.shape[-3]
    if groups is None:
        groups = max(g for g in range(1, min(27, channels) + 1) if channels % g == 0)
    lead = x.shape[:-3]
    grouped = x.reshape(*lead, groups, -1)
    mean = grouped.mean(dim=-1, keepdim=True)
    std = grouped.var(dim=-1, unbiased=False, keepdim=True).sqrt()
    normalized = ((grouped - mean) / (std + eps)).reshape(x.shape)
    padding = (x.reshape(*lead, -1) == 0).all(dim=-1)
    return normalized.masked_fill(padding.reshape(*lead, 1, 1, 1), 0.0)


def normalize_samples(data: FederatedData) -> FederatedData:
    """`data` with every sample's features group-normalised on their own (`sample_group_norm`)."""
    train = ClientTensors(sample_group_norm(data.train.x), data.train.y, data.train.n)
    test = ClientTensors(sample_group_norm(data.test.x), data.test.y, data.test.n)
    held = data.global_test
    if held is not None:
        held = ClientTensors(sample_group_norm(held.x), held.y, held.n)
    return dataclasses.replace(data, train=train, test=test, global_test=held)
