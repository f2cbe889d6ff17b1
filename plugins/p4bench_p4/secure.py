"""P4's secure aggregation: anomaly detection, then m-Krum on the survivors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench_defenses.anomaly import AnomalyDetection
from p4bench_defenses.krum import MultiKrum

if TYPE_CHECKING:
    from p4bench.config import RunConfig


class P4Secure(Defense):
    """Anomaly detection (paper 3-sigma rule by default, option `anomaly_variant`)
    followed by m-Krum on the surviving updates, applied by each group's aggregator to
    that group's updates only. (The paper's third layer, the client's KL term between
    its private model and the proxy, lives in the P4 method itself.)"""

    name = "p4-secure"
    description = "P4's secure aggregation: anomaly detection then m-Krum, per group"
    # both layers read the run's options; assumed_fraction is shared
    options = tuple({o.name: o for o in AnomalyDetection.options + MultiKrum.options}.values())
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.anomaly = AnomalyDetection(config)
        self.krum = MultiKrum(config)

    def select(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> torch.Tensor:
        survivors = self.anomaly.select(updates, weights, mask, **identities)
        return self.krum.select(updates, weights, survivors) & survivors
