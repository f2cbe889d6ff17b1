"""Anomaly detection ("Kick bad guys out!", Han et al. 2023) as the P4 paper states it,
with the FedML implementation as an option.

Paper (default, `anomaly_variant: paper`): the reference is the mean of the n - f
lowest-Krum-score updates; each update's score is its L2 distance to the reference;
updates scoring above mean + lambda * std of the scores (population std) are dropped,
lambda = 3 (option `anomaly_lambda`). Stateless. Note that a z-score can never exceed
sqrt(n - 1), so with n <= 10 updates per receiver the 3-sigma rule drops nothing.

FedML variant (`anomaly_variant: fedml`, FedSecurity's `anomaly_detection`): lambda = 0.5,
sample std (n - 1), and per receiver a running reference, seeded from the
ceil(n/2) - 1 lowest-Krum-score updates and then replaced by the mean of the survivors.
A cross-round cosine check flags an update whose cosine similarity with that sender's
last accepted update (at this receiver) or with the receiver's reference is below
`cosine_bound` (0.5); every update is flagged at a receiver's first aggregation. Only
flagged updates above the bound are dropped, and the memory is refreshed only when
something was flagged. FedML works on the final layer of models; here the features are
the whole ``update.*`` vectors the receiver gets, and the reference stands in for
FedML's global model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.options import Option
from p4bench_defenses._common import PairMemory, ReceiverMemory, receivers_or_default
from p4bench_defenses.krum import ASSUMED_FRACTION, assumed_byzantine, krum_scores, lowest

if TYPE_CHECKING:
    from p4bench.config import RunConfig

VARIANTS = ("paper", "fedml")


def masked_mean(updates: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """(B, P) mean of the updates marked in `which` (B, n), float64."""
    w = which.double().unsqueeze(-1)
    return (updates.double() * w).sum(1) / w.sum(1).clamp_min(1)


def outliers(distance: torch.Tensor, mask: torch.Tensor, factor: float, ddof: int) -> torch.Tensor:
    """(B, n) bool: distances above mean + factor * std of the real finite ones in their
    row; a non-finite distance (an overflowed norm) is always an outlier."""
    finite = torch.isfinite(distance) & mask
    distance_ = torch.where(finite, distance, 0.0)  # keeps inf out of the mean and std
    count = finite.sum(1).double()
    mean = distance_.sum(1) / count.clamp_min(1)
    var = ((distance_ - mean.unsqueeze(1)).pow(2) * finite).sum(1) / (count - ddof).clamp_min(1)
    return ((distance_ > (mean + factor * var.sqrt()).unsqueeze(1)) | ~finite) & mask


class AnomalyDetection(Defense):
    """Drop updates far from a robust reference (mean + lambda * std rule)."""

    name = "anomaly-detection"
    description = (
        "drop updates whose distance to a Krum-seeded reference exceeds mean + lambda*std "
        "(paper: 3 sigma; option FedML's)"
    )
    options = (
        Option(
            "anomaly_variant",
            str,
            "paper",
            "the paper's 3-sigma rule (stateless) or FedML's (running reference, cosine check)",
            choices=VARIANTS,
        ),
        Option(
            "anomaly_lambda",
            float,
            None,
            "lambda of the mean + lambda * std rule; default: 3 (paper), 0.5 (fedml)",
            low=0,
        ),
        Option(
            "cosine_bound",
            float,
            0.5,
            "fedml variant: least cosine similarity of an unflagged update",
            low=-1,
            high=1,
        ),
        ASSUMED_FRACTION,
    )
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        values = self.option_values
        self.variant: str = values["anomaly_variant"]
        self.factor: float = (
            values["anomaly_lambda"]
            if values["anomaly_lambda"] is not None
            else (3.0 if self.variant == "paper" else 0.5)
        )
        self.cosine_bound: float = values["cosine_bound"]
        self.references = ReceiverMemory()  # FedML variant: running reference per receiver
        self.accepted = PairMemory()  # FedML variant: last accepted update per (receiver, sender)

    def select(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> torch.Tensor:
        if self.variant == "paper":
            return self._paper(updates, mask)
        return self._fedml(updates, mask, *receivers_or_default(identities, mask))

    def _seed_reference(
        self,
        updates: torch.Tensor,
        mask: torch.Tensor,
        share: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        n = mask.sum(dim=1)
        scores = krum_scores(updates, mask, assumed_byzantine(self.config, n))
        return masked_mean(updates, lowest(scores, share(n).clamp_min(1)) & mask)

    def _paper(self, updates: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        reference = self._seed_reference(
            updates, mask, lambda n: n - assumed_byzantine(self.config, n)
        )
        distance = (updates.double() - reference.unsqueeze(1)).norm(dim=2).masked_fill(~mask, 0.0)
        return mask & ~outliers(distance, mask, self.factor, ddof=0)

    def _fedml(
        self,
        updates: torch.Tensor,
        mask: torch.Tensor,
        receivers: torch.Tensor,
        senders: torch.Tensor,
    ) -> torch.Tensor:
        stored, known = self.references.gather(receivers, updates.shape[2], torch.float64)
        seeded = self._seed_reference(updates, mask, lambda n: torch.ceil(n / 2).long() - 1)
        reference = torch.where(known.unsqueeze(1), stored, seeded)
        distance = (updates.double() - reference.unsqueeze(1)).norm(dim=2).masked_fill(~mask, 0.0)
        flagged = self._flagged(updates, mask, receivers, senders, reference, known)
        dropped = outliers(distance, mask, self.factor, ddof=1) & flagged
        kept = mask & ~dropped
        attacked = flagged.any(dim=1)  # FedML refreshes its memory only in flagged rounds
        if bool(attacked.any()):
            rows = attacked.nonzero().squeeze(1)
            self.accepted.put(receivers, senders, updates.double(), kept & attacked.unsqueeze(1))
            self.references.put(receivers[rows], masked_mean(updates, kept)[rows])
        return kept

    def _flagged(
        self,
        updates: torch.Tensor,
        mask: torch.Tensor,
        receivers: torch.Tensor,
        senders: torch.Tensor,
        reference: torch.Tensor,
        known: torch.Tensor,
    ) -> torch.Tensor:
        """(B, n): every update at a receiver's first aggregation, later those whose cosine
        with the sender's last accepted update or with the reference is below the bound."""
        last, has_last = self.accepted.gather(receivers, senders, updates.double())
        last = torch.where(has_last.unsqueeze(-1), last, reference.unsqueeze(1))
        cosine = torch.nn.functional.cosine_similarity
        own = cosine(updates.double(), last, dim=2)
        common = cosine(updates.double(), reference.unsqueeze(1).expand_as(last), dim=2)
        suspicious = (own < self.cosine_bound) | (common < self.cosine_bound)
        return mask & (suspicious | ~known.unsqueeze(1))
