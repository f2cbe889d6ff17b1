"""Record isolation: a record may move only its own term of a release.

A DP release is a sum of per-record clipped terms plus noise; its analysis bounds how
much *one* record can change that sum (its own term: the clip norm). That bound fails
when a record also moves other records' terms: a teacher trained without DP on the same
records (ProxyFL's paper teacher), batch statistics, a normalisation fitted to the
client's data. The post-processing check (`p4bench.privacy.post_processing`) cannot see
this: the leak is inside the release, so forcing the release hides it.

The isolation replay can. About half of every client's training records are *changed*
(a random half, drawn from the run's seed: `changed_slots`); in the recorded run and in
its replay, where those records are replaced by others (`with_changed_records`) and every
release is forced to its recorded value, each per-example clipped sum
(`clipped_gradient_sum`) is also computed without the changed records' own terms (the
*kept* sum, beside the sum the run uses; `kept_mask`). The kept sums must be
bit-identical in both runs: the changed records enter no clipped sum but through their
own terms, and the rest of the run is a function of the releases. A kept sum that
differs names the sum, the round and the batch row whose other records' terms moved.

Changed records are found in a batch by their features (the exact bits, through
`p4bench.privacy.fingerprint`), so a method that transforms its inputs between the data
and the clipping hides them: the check then finds no changed record in any clipped batch
and says it could not run (`matched`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from p4bench.privacy.fingerprint import row_fingerprints

if TYPE_CHECKING:
    from p4bench.data.federated import ClientTensors

__all__ = [
    "ChangedRecords",
    "changed_slots",
    "current_changed",
    "excluding",
    "features_at",
    "kept_mask",
    "with_changed_records",
]

_CHANGED: ContextVar[ChangedRecords | None] = ContextVar("p4bench_changed_records", default=None)
SLOT_SEED = 0x1507_A7E5  # mixed with the run's seed: which records change is the run's own draw


def _key(fingerprints: npt.NDArray[np.int64]) -> torch.Tensor:
    """One int64 per row for a sorted membership test (its candidates are confirmed on
    the exact features, so one of the two fingerprints is enough)."""
    return torch.from_numpy(np.ascontiguousarray(fingerprints[:, 0]))


class ChangedRecords:
    """The changed records' flattened features in one run, and how many batch entries
    matched them (`matched`)."""

    def __init__(self, features: torch.Tensor | None = None) -> None:
        self.matched = 0
        self.features: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None
        self._order: torch.Tensor | None = None
        if features is not None:
            self.use(features)

    def use(self, features: torch.Tensor) -> None:
        """The changed records' flattened features (g, d) on the CPU, once the run's data is known."""
        self.features = features
        self._keys = self._order = None
        if len(features):
            self._keys, self._order = torch.sort(_key(row_fingerprints(features)))

    def hits(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(C, b) bool: the batch entries of `x` (C, b, ...) that are changed records and in `mask`."""
        count, width = int(x.shape[0]), int(x.shape[1]) if x.dim() > 1 else 0
        hit = torch.zeros(count, width, dtype=torch.bool)
        features = self.features
        if (
            features is None
            or self._keys is None
            or self._order is None
            or x.dim() < 2
            or not x.numel()
        ):
            return hit.to(mask.device)
        flat = x.detach().reshape(count * width, -1)
        if flat.shape[1] != features.shape[1] or flat.dtype != features.dtype:
            return hit.to(
                mask.device
            )  # not the records' features (a transformed input): nothing matches
        keys = _key(row_fingerprints(flat))
        position = torch.searchsorted(self._keys, keys).clamp(max=len(self._keys) - 1)
        candidate = self._keys[position] == keys
        if bool(candidate.any()):
            rows = candidate.nonzero().flatten()
            same = (flat[rows].cpu() == features[self._order[position[rows]]]).all(dim=1)
            candidate[rows] = same
        hit = candidate.reshape(count, width).to(mask.device) & (mask != 0)
        self.matched += int(hit.sum())
        return hit


def kept_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """Inside a run that checks isolation: `mask` with the changed records' entries at 0
    (the kept sum's batch), or None where no changed record is in the batch (the kept sum
    is the sum itself). Outside one: None."""
    changed = _CHANGED.get()
    if changed is None:
        return None
    hit = changed.hits(x, mask)
    if not bool(hit.any()):
        return None
    return mask * ~hit if mask.dtype == torch.bool else mask * (~hit).to(mask.dtype)


def current_changed() -> ChangedRecords | None:
    """The changed records of the run being checked in this context, or None."""
    return _CHANGED.get()


@contextmanager
def excluding(changed: ChangedRecords) -> Iterator[ChangedRecords]:
    """Compute every clipped sum made inside the block also without `changed`'s records."""
    token = _CHANGED.set(changed)
    try:
        yield changed
    finally:
        _CHANGED.reset(token)


def _members(candidates: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """(len(candidates),) bool: rows of `candidates` equal to some row of `pool` (exact)."""
    if not len(candidates) or not len(pool):
        return torch.zeros(len(candidates), dtype=torch.bool)
    keys, order = torch.sort(_key(row_fingerprints(pool)))
    wanted = _key(row_fingerprints(candidates))
    position = torch.searchsorted(keys, wanted).clamp(max=len(keys) - 1)
    found = keys[position] == wanted
    rows = found.nonzero().flatten()
    found[rows] = (candidates[rows] == pool[order[position[rows]]]).all(dim=1)
    return found


def changed_slots(train: ClientTensors, replacement: ClientTensors, seed: int = 0) -> torch.Tensor:
    """(C, n_max) bool: the records the isolation replay changes, a random half of every
    client's records (drawn from `seed`), less any whose original or replacement features
    equal a kept record's (exact duplicates would be taken out of the kept sums with them)."""
    count, width = train.y.shape
    slot = torch.arange(width)
    present = slot[None, :] < train.n[:, None].cpu()
    generator = torch.Generator().manual_seed((int(seed) ^ SLOT_SEED) % (2**63))
    coin = torch.rand(count, width, generator=generator) < 0.5
    chosen = coin & present
    flat = train.x.reshape(count, width, -1).cpu()
    other = replacement.x.reshape(count, width, -1).cpu()
    while (
        True
    ):  # a slot given up joins the kept records, which may clash with another: until none does
        kept_rows = flat[present & ~chosen]
        clash = _members(flat[chosen], kept_rows) | _members(other[chosen], kept_rows)
        if not bool(clash.any()):
            return chosen.to(torch.bool)
        positions = chosen.nonzero()
        chosen[positions[clash, 0], positions[clash, 1]] = False


def with_changed_records(
    train: ClientTensors, replacement: ClientTensors, slots: torch.Tensor
) -> ClientTensors:
    """`train` with the records at `slots` taken from `replacement` (same counts)."""
    from p4bench.data.federated import ClientTensors  # noqa: F811 - the runtime import of the type

    x, y = train.x.clone(), train.y.clone()
    device_slots = slots.to(x.device)
    x[device_slots], y[device_slots] = replacement.x[device_slots], replacement.y[device_slots]
    return ClientTensors(x, y, train.n.clone())


def features_at(train: ClientTensors, slots: torch.Tensor) -> torch.Tensor:
    """(g, d) the flattened features of the records at `slots`, on the CPU."""
    features: torch.Tensor = (
        train.x.reshape(*train.y.shape, -1)[slots.to(train.x.device)].cpu().clone()
    )
    return features
