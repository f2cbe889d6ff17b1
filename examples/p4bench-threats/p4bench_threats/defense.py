"""A defense that bounds each received update's norm by the median norm."""

import torch

from p4bench.api import Defense


class MedianNormClip(Defense):
    """Scale every received update down to the median norm of its receiver's updates,
    then take the senders' weighted mean.

    The aggregator calls `aggregate` with every receiver's updates at once: `updates`
    (B, n, P), `weights` (B, n) and `mask` (B, n), True where a real update sits (rows
    are padded to the largest inbox). It returns the aggregates (B, P) and which updates
    were kept (B, n): here all of them, scaled, so `filters` is False.
    """

    name = "median-norm-clip"
    description = (
        "clip every received update to the median norm of its receiver's updates, then average "
        "(example plugin)"
    )
    filters = False

    def aggregate(self, updates, weights, mask, **identities):
        norms = torch.linalg.vector_norm(updates.double(), dim=2)  # (B, n)
        padded = torch.where(mask, norms, torch.nan)
        bound = torch.nanquantile(padded, 0.5, dim=1, keepdim=True).nan_to_num(0.0)  # (B, 1)
        scale = torch.where(norms > bound, bound / norms.clamp_min(1e-12), torch.ones_like(norms))
        used = weights.double() * mask
        total = used.sum(dim=1, keepdim=True).clamp_min(1e-12)
        mean = ((scale * used / total).unsqueeze(2) * updates.double()).sum(dim=1)
        return mean.to(updates.dtype), mask.clone()
