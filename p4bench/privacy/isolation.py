"""Record isolation: a record may move only its own term of a release.

A DP release is a sum of per-record clipped terms plus noise; its analysis bounds how
much *one* record can change that sum (its own term: the clip norm). That bound fails
when a record also moves other records' terms: a teacher trained without DP on the same
records (ProxyFL's paper teacher), batch statistics, a normalisation fitted to the
client's data. The post-processing check (`p4bench.privacy.post_processing`) cannot see
this: the leak is inside the release, so forcing the release hides it.

The isolation replay can. It marks half of every client's training records as
*changed* (even slots; `changed_slots`), runs the method with their own terms taken out
of every clipped sum (`clipped_gradient_sum` drops a batch entry whose features equal a
changed record's, `excluded_mask`), then again with those records replaced by others
(`with_changed_records`), every release forced to its recorded value as in the
post-processing replay. The clipped sums before noise (`ReleaseTape.clean`) must then
be bit-identical: the changed records enter no release through their own terms, and the
rest of the run is a function of the releases. A sum that differs names the release,
the phase and the client whose other records' terms moved.

Changed records are found in a batch by their features (exact equality), so a method
that transforms its inputs between the data and the clipping hides them: the check then
finds no changed record in any clipped batch and says it could not run (`matched`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from p4bench.data.federated import ClientTensors

__all__ = ["ChangedRecords", "changed_slots", "excluded_mask", "excluding", "features_at", "with_changed_records"]

_CHANGED: ContextVar[ChangedRecords | None] = ContextVar("p4bench_changed_records", default=None)
_GHOST_CHUNK = 64  # changed records compared with a batch at once (bounds the (C, b, chunk, d) comparison)


@dataclass
class ChangedRecords:
    """The changed records' flattened features in this run (`features` (g, d), set once the
    run's data is known) and how many batch entries matched them."""

    features: torch.Tensor | None = None
    matched: int = 0

    def mask(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask` with every entry whose features equal a changed record's set to 0."""
        if self.features is None or not len(self.features) or x.dim() < 2:
            return mask
        flat = x.reshape(*x.shape[:2], -1)
        ghosts = self.features.to(flat.device, flat.dtype)
        if ghosts.shape[1] != flat.shape[2]:
            return mask  # not the records' features (a transformed input): nothing matches
        hit = torch.zeros(flat.shape[:2], dtype=torch.bool, device=flat.device)
        for start in range(0, len(ghosts), _GHOST_CHUNK):
            part = ghosts[start : start + _GHOST_CHUNK]
            hit |= (flat[:, :, None, :] == part[None, None]).all(dim=3).any(dim=2)
        self.matched += int((hit & (mask != 0)).sum())
        return mask * ~hit if mask.dtype == torch.bool else mask * (~hit).to(mask.dtype)


def excluded_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The batch mask a clipped sum uses: `mask` itself, except inside an isolation
    replay, where the changed records' entries are 0."""
    changed = _CHANGED.get()
    return mask if changed is None else changed.mask(x, mask)


@contextmanager
def excluding(changed: ChangedRecords) -> Iterator[ChangedRecords]:
    """Take `changed`'s records out of every clipped sum made inside the block."""
    token = _CHANGED.set(changed)
    try:
        yield changed
    finally:
        _CHANGED.reset(token)


def changed_slots(train: ClientTensors, replacement: ClientTensors) -> torch.Tensor:
    """(C, n_max) bool: the records the isolation replay changes, every client's even
    slots below its count, less any whose original or replacement features equal a kept
    record's (exact duplicates would be taken out of the sums with them)."""
    count, width = train.y.shape
    slot = torch.arange(width)
    chosen = (slot % 2 == 0)[None, :] & (slot[None, :] < train.n[:, None].cpu())
    kept = (slot % 2 == 1)[None, :] & (slot[None, :] < train.n[:, None].cpu())
    flat = train.x.reshape(count, width, -1).cpu()
    kept_rows = flat[kept]
    for source in (flat, replacement.x.reshape(count, width, -1).cpu()):
        candidates = source[chosen]
        clash = torch.zeros(len(candidates), dtype=torch.bool)
        for start in range(0, len(kept_rows), _GHOST_CHUNK):
            part = kept_rows[start : start + _GHOST_CHUNK]
            clash |= (candidates[:, None, :] == part[None]).all(dim=2).any(dim=1)
        positions = chosen.nonzero()
        chosen[positions[clash, 0], positions[clash, 1]] = False
    return chosen.to(torch.bool)


def with_changed_records(train: ClientTensors, replacement: ClientTensors, slots: torch.Tensor) -> ClientTensors:
    """`train` with the records at `slots` taken from `replacement` (same counts)."""
    from p4bench.data.federated import ClientTensors  # noqa: F811 - the runtime import of the type

    x, y = train.x.clone(), train.y.clone()
    x[slots], y[slots] = replacement.x[slots], replacement.y[slots]
    return ClientTensors(x, y, train.n.clone())


def features_at(train: ClientTensors, slots: torch.Tensor) -> torch.Tensor:
    """(g, d) the flattened features of the records at `slots`."""
    features: torch.Tensor = train.x.reshape(*train.y.shape, -1)[slots].cpu().clone()
    return features
