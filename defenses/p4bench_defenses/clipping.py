"""Clipping defenses: norm clipping and centered clipping, batched over receivers.

norm-clipping (Sun et al. 2019, "Can you really backdoor FL?"; FedSecurity's
norm_diff_clipping): each update is scaled to x / max(1, ||x|| / tau) and the weighted
mean taken. tau = option `norm_bound`; by default the median norm of the updates the
receiver got (adaptive, so the default suits any model scale).

centered-clipping (Karimireddy, He and Jaggi, ICML 2021): starting from v_0, the
receiver's previous aggregate (zeros at its first aggregation), iterate
v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i, with clip_tau(y) = y * min(1, tau / ||y||),
`cclip_iterations` (1) times; tau = option `cclip_tau` (10, FedSecurity's default).
The memory is kept per receiver.

Neither drops an update as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.engine.threats import weighted_mean
from p4bench.options import Option
from p4bench_defenses._common import ReceiverMemory, receivers_or_default
from p4bench_defenses.median import coordinate_median

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def clip_rows(vectors: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """(B, n, P) each vector scaled by min(1, bound[b] / ||vector||)."""
    norms = vectors.norm(dim=2, keepdim=True)
    return vectors * torch.clamp(bound.view(-1, 1, 1) / norms.clamp_min(1e-12), max=1.0)


class NormClipping(Defense):
    """Clip each update's L2 norm to tau, then take the weighted mean."""

    name = "norm-clipping"
    description = (
        "scale every update to L2 norm at most tau (default: the median norm), then average"
    )
    options = (
        Option(
            "norm_bound",
            float,
            None,
            "tau, the largest L2 norm kept; default: the median norm of the "
            "updates each receiver gets",
            low=0,
            low_open=True,
        ),
    )
    filters = False

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.bound: float | None = self.option_values["norm_bound"]

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = updates.double()
        if self.bound is None:
            norms = x.norm(dim=2).unsqueeze(-1)
            bound = coordinate_median(norms, mask).squeeze(1)
        else:
            bound = torch.full((x.shape[0],), self.bound, dtype=torch.float64)
        clipped = clip_rows(x, bound)
        return weighted_mean(clipped, weights * mask).to(updates.dtype), mask.clone()


class CenteredClipping(Defense):
    """Move from the previous aggregate by the mean of clipped differences."""

    name = "centered-clipping"
    description = (
        "centered clipping: v += mean(clip_tau(x_i - v)) from the receiver's previous aggregate"
    )
    options = (
        Option(
            "cclip_tau",
            float,
            10.0,
            "tau, the clipping radius around the previous aggregate",
            low=0,
            low_open=True,
        ),
        Option("cclip_iterations", int, 1, "clipping iterations per aggregation", low=1),
    )
    filters = False
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.tau: float = self.option_values["cclip_tau"]
        self.iterations: int = self.option_values["cclip_iterations"]
        self.previous = ReceiverMemory()

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        receivers, _ = receivers_or_default(identities, mask)
        x = updates.double()
        v, _ = self.previous.gather(receivers, x.shape[2], torch.float64)
        w = weights.double() * mask
        w = torch.where(w.sum(1, keepdim=True) > 0, w, mask.double())
        tau = torch.full((x.shape[0],), self.tau, dtype=torch.float64)
        for _ in range(self.iterations):
            v = v + weighted_mean(clip_rows(x - v.unsqueeze(1), tau), w)
        self.previous.put(receivers, v)
        return v.to(updates.dtype), mask.clone()
