"""From a partition to padded per-client tensors with an 80/20 split and client roles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from p4bench.data.base import ArrayDataset

_NORMS, _GRAM, _BASIS, _PARENT = (
    "_squared_norms",
    "_gram",
    "_basis",
    "_parent",
)  # caches outside the frozen fields
_MAX_COUNT = "_max_count"  # max(n), read once
_Derived = TypeVar("_Derived")  # what a per-dataset cache holds (`ClientTensors._derived`)


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """(C, n) squared L2 norms of flattened inputs (C, n, ...), without a full-size temporary."""
    norms: torch.Tensor = torch.linalg.vector_norm(
        x.flatten(start_dim=2), dim=2
    )  # torch.linalg is untyped
    return norms.square_()


def gram_matrices(x: torch.Tensor) -> torch.Tensor:
    """(C, n, n) inner products between each client's flattened inputs (C, n, ...)."""
    flat = x.flatten(start_dim=2)
    return torch.bmm(flat, flat.transpose(1, 2))


def orthonormal_bases(x: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Householder QR of every client's flattened inputs X (n, d): (Q^T (C, m, d) with
    orthonormal rows, R (C, m, n)), m = min(n, d), X = R^T Q^T. Q is orthonormal to
    rounding whatever X's conditioning or rank (padding rows are zeros). In chunks of
    clients, to bound the temporaries."""
    flat = x.flatten(start_dim=2)
    count, width, dim = flat.shape
    m = min(width, dim)
    basis = torch.empty(count, m, dim, device=flat.device)
    coords = torch.empty(count, m, width, device=flat.device)
    for start in range(0, count, chunk):
        q, r = torch.linalg.qr(flat[start : start + chunk].transpose(1, 2))
        basis[start : start + chunk] = q.transpose(1, 2)
        coords[start : start + chunk] = r
    return basis, coords


@dataclass(frozen=True)
class ClientTensors:
    """Samples of several clients, padded to a common length along axis 1.

    x: (C, n_max, *features) float32; y: (C, n_max) int64; n: (C,) valid counts.
    """

    x: torch.Tensor
    y: torch.Tensor
    n: torch.Tensor

    def rows(self, index: torch.Tensor) -> ClientTensors:
        """The clients at `index`, trimmed to their own longest length."""
        n = self.n[index]
        width = int(n.max()) if len(n) else 0
        if len(index) == len(self.n) and torch.equal(
            index.cpu(), torch.arange(len(self.n), device="cpu")
        ):
            # every client in order (one group holds them all): views, not a copy of the samples
            subset = ClientTensors(self.x[:, :width], self.y[:, :width], n)
        else:
            samples = self.x[
                index.to(self.x.device), :width
            ]  # streamed samples stay in host memory
            subset = ClientTensors(samples, self.y[index, :width], n)
        if _NORMS in self.__dict__:
            subset.__dict__[_NORMS] = self.__dict__[_NORMS][index, :width]
        subset.__dict__[_PARENT] = (self, index, width)  # `gram` computes once, on the parent
        subset.__dict__[_MAX_COUNT] = width
        return subset

    def max_count(self) -> int:
        """max(n), the longest client's sample count: read once per dataset (on a GPU each
        read is a synchronisation), known without a read for subsets taken with `rows`."""
        if _MAX_COUNT not in self.__dict__:
            self.__dict__[_MAX_COUNT] = int(self.n.max()) if len(self.n) else 0
        return int(self.__dict__[_MAX_COUNT])

    def squared_norms(self) -> torch.Tensor:
        """(C, n_max) squared L2 norm of every sample's flattened features, computed once
        (per-example clipping of linear models needs them at every DP step)."""
        if _NORMS not in self.__dict__:  # frozen dataclass: cache outside the fields
            self.__dict__[_NORMS] = squared_norms(self.x).to(
                self.n.device
            )  # streamed samples: on the host, moved once
        norms: torch.Tensor = self.__dict__[_NORMS]
        return norms

    def gram(self) -> torch.Tensor:
        """(C, n_max, n_max) inner products of every client's flattened samples, computed
        once per dataset: a subset taken with `rows` (the clients of one round) reads
        its parent's, so partial participation does not recompute it every round."""
        # annotated: Tensor indexing is untyped, so the selector's result (hence the call's) is Any
        matrices: torch.Tensor = self._derived(
            _GRAM, gram_matrices, lambda gram, index, width: gram[index, :width, :width]
        )
        return matrices

    def orthonormal_basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q^T (C, m, d), R (C, m, n_max)) with X = R^T Q^T per client (`orthonormal_bases`),
        computed once per dataset and shared with row subsets like `gram`."""
        basis: tuple[torch.Tensor, torch.Tensor] = self._derived(  # annotated: as in `gram`
            _BASIS,
            orthonormal_bases,
            lambda basis, index, width: (basis[0][index], basis[1][index, :, :width]),
        )
        return basis

    def has_orthonormal_basis(self) -> bool:
        """Whether `orthonormal_basis` is already computed (here or on the parent)."""
        parent = self.__dict__.get(_PARENT)
        return _BASIS in self.__dict__ or (parent is not None and parent[0].has_orthonormal_basis())

    def _derived(
        self,
        name: str,
        compute: Callable[[torch.Tensor], _Derived],
        select: Callable[[_Derived, torch.Tensor, int], _Derived],
    ) -> _Derived:
        """A per-dataset cache: computed from x, or selected from the parent's cache."""
        if name not in self.__dict__:
            parent = self.__dict__.get(_PARENT)
            if parent is None:
                self.__dict__[name] = compute(self.x)
            else:
                source, index, width = parent
                value = source._derived(name, compute, select)
                whole = width == source.x.shape[1] and torch.equal(
                    index, torch.arange(len(source.n))
                )
                self.__dict__[name] = (
                    value if whole else select(value, index, width)
                )  # all rows: no copy
        cached: _Derived = self.__dict__[name]
        return cached

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.y.shape[1], device=self.n.device) < self.n.unsqueeze(1)

    def nbytes(self) -> int:
        """Bytes of the samples, labels and counts."""
        return sum(t.numel() * t.element_size() for t in (self.x, self.y, self.n))

    def to(self, device: torch.device, stream: bool = False) -> ClientTensors:
        """These tensors on `device`; with `stream`, the samples stay in pinned host memory
        (labels and counts move) and `gather_batch` moves each batch to the device."""
        if device.type == "cpu":
            return self
        x = (
            (self.x.pin_memory() if device.type == "cuda" else self.x)
            if stream
            else self.x.to(device)
        )
        return ClientTensors(x, self.y.to(device), self.n.to(device))

    @staticmethod
    def from_lists(
        xs: list[np.ndarray], ys: list[np.ndarray], feature_shape: tuple[int, ...]
    ) -> ClientTensors:
        count = len(xs)
        width = max((len(y) for y in ys), default=0)
        x = np.zeros((count, width, *feature_shape), dtype=np.float32)
        y = np.zeros((count, width), dtype=np.int64)
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            x[i, : len(yi)] = xi
            y[i, : len(yi)] = yi
        n = torch.tensor([len(yi) for yi in ys], dtype=torch.int64)
        return ClientTensors(torch.from_numpy(x), torch.from_numpy(y), n)


@dataclass(frozen=True)
class FederatedData:
    """Every client's train and test tensors, and which clients are evaluation clients."""

    train: ClientTensors
    test: ClientTensors
    evaluation: torch.Tensor  # (M,) bool: used for tuning only, excluded from reports
    num_classes: int
    feature_shape: tuple[int, ...]
    class_names: tuple[str, ...]
    client_indices: tuple[np.ndarray, ...]  # pooled-dataset indices per client (train + test)
    # one test set for every client (`--eval global|both`, `p4bench.data.global_test`), (1, N, ...)
    global_test: ClientTensors | None = None

    @property
    def num_clients(self) -> int:
        return int(self.train.n.shape[0])

    def nbytes(self) -> int:
        """Bytes of every client's train and test tensors, and of the global test set."""
        return (
            self.train.nbytes()
            + self.test.nbytes()
            + (self.global_test.nbytes() if self.global_test is not None else 0)
        )

    def to(self, device: torch.device, stream: bool = False) -> FederatedData:
        """The clients' tensors on `device` (this object itself on the CPU); `stream`
        keeps the samples in pinned host memory (`ClientTensors.to`)."""
        if device.type == "cpu":
            return self
        return dataclasses.replace(
            self,
            train=self.train.to(device, stream),
            test=self.test.to(device, stream),
            evaluation=self.evaluation.to(device),
            global_test=None if self.global_test is None else self.global_test.to(device, stream),
        )


def split_client_indices(
    indices: np.ndarray, labels: np.ndarray, rng: np.random.Generator, test_fraction: float = 0.2
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's samples into train/test so that the test set follows the
    client's own class distribution: within each class, every fifth sample (in random
    order) goes to test, giving test_fraction of each class up to rounding.
    """
    period = round(1 / test_fraction)
    order = np.lexsort((rng.random(len(indices)), labels[indices]))
    ranked = indices[order]
    class_of = labels[ranked]
    position_in_class = np.arange(len(ranked)) - np.searchsorted(class_of, class_of, side="left")
    # Offset the phase per class randomly so small classes do not always land in train.
    phase = rng.integers(0, period, size=int(labels.max()) + 1)
    is_test = (position_in_class + phase[class_of]) % period == period - 1
    return ranked[~is_test], ranked[is_test]


def build_federated_data(
    dataset: ArrayDataset,
    partition: list[np.ndarray],
    eval_fraction: float,
    rng: np.random.Generator,
) -> FederatedData:
    """Split every client's partition 80/20 and pad everything into ClientTensors."""
    x, y = dataset.pooled()
    xs_train, ys_train, xs_test, ys_test = [], [], [], []
    for indices in partition:
        train, test = split_client_indices(np.asarray(indices), y, rng)
        xs_train.append(x[train])
        ys_train.append(y[train])
        xs_test.append(x[test])
        ys_test.append(y[test])
    count = len(partition)
    evaluation = np.zeros(count, dtype=bool)
    evaluation[rng.permutation(count)[: int(round(eval_fraction * count))]] = True
    return FederatedData(
        train=ClientTensors.from_lists(xs_train, ys_train, dataset.feature_shape),
        test=ClientTensors.from_lists(xs_test, ys_test, dataset.feature_shape),
        evaluation=torch.from_numpy(evaluation),
        num_classes=dataset.num_classes,
        feature_shape=dataset.feature_shape,
        class_names=dataset.class_names,
        client_indices=tuple(np.asarray(p) for p in partition),
    )


def evaluation_clients_only(data: FederatedData) -> FederatedData:
    """The federation made of `data`'s evaluation clients alone, in their order, each with
    its own train and test tensors (copies, trimmed to the longest kept client) and its
    pooled-dataset indices; every kept client is an evaluation client. Tuning runs use it
    (`RunConfig.federation_clients`) so that no reported client's record takes part."""
    index = torch.nonzero(data.evaluation.cpu()).flatten()

    def keep(tensors: ClientTensors) -> ClientTensors:
        n = tensors.n[index.to(tensors.n.device)].clone()
        width = int(n.max()) if len(n) else 0
        return ClientTensors(
            tensors.x[index.to(tensors.x.device), :width].clone(),
            tensors.y[index.to(tensors.y.device), :width].clone(),
            n,
        )

    return dataclasses.replace(
        data,
        train=keep(data.train),
        test=keep(data.test),
        evaluation=torch.ones(len(index), dtype=torch.bool),
        client_indices=tuple(data.client_indices[int(i)] for i in index),
    )
