"""Canary records for the method-level audit: input-space records in the clients' data.

The audit flattens every record (the linear model it needs flattens them anyway) and
appends D = clients x m marker feature columns to it (zero for every real record:
public knowledge, not a change of the method). Canary
(i, k) of client i owns marker column j(i, k) (all distinct) and has public labels
c (its own), c' (its replacement's, under replace-one) and l (its probe's), all
distinct; its secret is the inclusion bit b(i, k) ~ Bernoulli(1/2) of the audit seed.

- b = 1: client i trains on the canary x = v e_j, y = c.
- b = 0: add-remove: the canary is absent; replace-one: client i trains on the
  replacement x = v e_j, y = c' instead (the neighbouring data set replaces one record).
- Always, client i also holds the canary's `PROBES` *probe twins* x = s v e_j, y = l
  (s = `PROBE_SCALE`): public records whose gradients say nothing about b under DP,
  but which carry the canary's label when a method distils them from a model that
  learnt the canary without DP (ProxyFL's teacher=private). Several probes at half
  scale: on digits at epsilon 8 they showed the largest gap between ProxyFL's
  teacher=private and teacher=none of the settings tried (1, 2, 4 or 8 probes at
  1/8 to 1 x v), a gap of about 30% in the scores' separation (d' 0.95 against 0.73).

v = `MARKER_SCALE` x C makes a canary's per-example gradient norm several times the clip
norm (|x| = v, |p - onehot(y)| close to 1 until it is learned), so clipping binds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from p4bench.data.federated import ClientTensors, FederatedData
from p4bench.data.public import PublicData
from p4bench.errors import IncompatibleError

__all__ = ["RecordCanaries", "MARKER_SCALE"]

MARKER_SCALE = 10.0  # v / C
PROBES = 4  # probe twins per canary
PROBE_SCALE = 0.5  # a probe's marker value, relative to v


class RecordCanaries:
    """The canaries of one run (`m` per client) and the data transform that plants them."""

    def __init__(
        self,
        num_clients: int,
        per_client: int,
        num_classes: int,
        seed: int,
        clip: float,
        neighbouring: str,
        probes: int = PROBES,
        probe_scale: float = PROBE_SCALE,
    ) -> None:
        if num_classes < 3:
            raise IncompatibleError(
                f"the method-level audit needs at least 3 classes (canary, replacement and probe "
                f"labels), the data set has {num_classes}"
            )
        self.num_clients, self.per_client, self.num_classes = num_clients, per_client, num_classes
        self.neighbouring = neighbouring
        self.value = MARKER_SCALE * float(clip)
        self.probes, self.probe_value = int(probes), float(probe_scale) * self.value
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xCA7A, 1]))
        shape = (num_clients, per_client)
        self.included = rng.random(shape) < 0.5
        # three distinct labels per canary: c (canary), c' (replacement), l (probe)
        labels = np.argsort(rng.random((*shape, num_classes)), axis=-1)[..., :3]
        self.label, self.other, self.probe = labels[..., 0], labels[..., 1], labels[..., 2]
        self.columns = np.arange(num_clients * per_client).reshape(
            shape
        )  # marker column of canary (i, k)
        self.base_features = 0  # the real features' width, set by `transform`

    @property
    def markers(self) -> int:
        """D, the marker columns appended to every record."""
        return self.num_clients * self.per_client

    def transform(
        self, data: FederatedData, public: PublicData | None
    ) -> tuple[FederatedData, PublicData | None]:
        """`runner.prepare`'s data transform: markers appended to every record, the canary
        (or its replacement) and its probe appended to the client's training records."""
        if data.num_clients != self.num_clients or data.num_classes != self.num_classes:
            raise IncompatibleError(
                "the canaries were drawn for another number of clients or classes"
            )
        # the linear model flattens its input: the markers go after the flattened features
        self.base_features = int(np.prod(data.feature_shape))
        width = self.base_features + self.markers
        train, test = self._with_canaries(data.train, width), _widened(data.test, width)
        data = dataclasses.replace(data, train=train, test=test, feature_shape=(width,))
        if public is not None:
            public = _widened_public(public, width)
        return data, public

    def _with_canaries(self, train: ClientTensors, width: int) -> ClientTensors:
        m = self.per_client
        kept = self.included | (
            self.neighbouring == "replace-one"
        )  # records in client i's data, besides probes
        extra = kept.sum(1) + m * self.probes
        n = train.n + torch.from_numpy(extra)
        size = int(n.max())
        x = torch.zeros(self.num_clients, size, width, dtype=train.x.dtype)
        y = torch.zeros(self.num_clients, size, dtype=train.y.dtype)
        x[:, : train.x.shape[1], : self.base_features] = train.x.flatten(start_dim=2)
        y[:, : train.y.shape[1]] = train.y
        for i in range(self.num_clients):
            start = int(train.n[i])
            chosen = np.flatnonzero(kept[i])
            label = np.where(self.included[i, chosen], self.label[i, chosen], self.other[i, chosen])
            probes = np.repeat(self.columns[i], self.probes)
            columns = np.r_[
                self.columns[i, chosen], probes
            ]  # canaries (or replacements), then probes
            labels = np.r_[label, np.repeat(self.probe[i], self.probes)]
            rows = torch.arange(start, start + len(columns))
            values = torch.tensor(
                [self.value] * len(chosen) + [self.probe_value] * len(probes), dtype=x.dtype
            )
            x[i, rows, torch.from_numpy(self.base_features + columns)] = values
            y[i, rows] = torch.from_numpy(labels.astype(np.int64))
        return ClientTensors(x, y, n)

    def parameter_index(self, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
        """Flat indices, in `vectorize` order of a linear model {bias (K,), weight (K, d)},
        of W[c, j] and of the reference: (M, m) and (M, m, R) with R = 1 (c' under
        replace-one) or K - 1 (every other class under add-remove)."""
        width = self.base_features + self.markers
        column = self.base_features + self.columns
        own = num_classes + self.label * width + column
        if self.neighbouring == "replace-one":
            reference = (num_classes + self.other * width + column)[..., None]
        else:
            classes = np.arange(num_classes)
            others = np.stack([np.delete(classes, c) for c in range(num_classes)])  # (K, K-1)
            reference = num_classes + others[self.label] * width + column[..., None]
        return own, reference


def _widened(tensors: ClientTensors, width: int) -> ClientTensors:
    flat = tensors.x.flatten(start_dim=2)
    x = torch.zeros(*flat.shape[:2], width, dtype=flat.dtype)
    x[..., : flat.shape[2]] = flat
    return ClientTensors(x, tensors.y, tensors.n)


def _widened_public(public: PublicData, width: int) -> PublicData:
    load = public.load

    def widened() -> np.ndarray:
        x = np.asarray(load(), dtype=np.float32).reshape(-1, int(np.prod(public.feature_shape)))
        out = np.zeros((len(x), width), dtype=np.float32)
        out[:, : x.shape[1]] = x
        return out

    return dataclasses.replace(public, load=widened, feature_shape=(width,), _splits=None)
