"""FoolsGold (Fung, Yoon and Beschastnikh, RAID 2020): down-weight clients whose update
histories point the same way (sybils), batched over receivers.

Per receiver, each sender's history H_i is the sum of the updates it sent there. With
cs_ij the cosine similarity of H_i and H_j (i != j) and v_i = max_j cs_ij, similarities
are pardoned (cs_ij *= v_i / v_j when v_i < v_j), alpha_i = 1 - max_j cs_ij is clipped to
[0, 1], divided by its maximum, 1 becomes 0.99, and the logit
alpha_i = kappa * (ln(alpha_i / (1 - alpha_i)) + 0.5) (kappa = option `foolsgold_kappa`, 1) is
clipped to [0, 1]. The aggregate is the mean weighted by w_i * alpha_i; updates with
alpha_i = 0 count as dropped. Features are the whole update vector (the paper's optional
importance weighting of output-layer features is not applied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Defense
from p4bench.engine.threats import weighted_mean
from p4bench.options import Option
from p4bench_defenses._common import PairMemory, receivers_or_default

if TYPE_CHECKING:
    from p4bench.config import RunConfig


def foolsgold_weights(
    histories: torch.Tensor, mask: torch.Tensor, kappa: float = 1.0
) -> torch.Tensor:
    """(B, n) FoolsGold learning rates alpha in [0, 1] from histories (B, n, P)."""
    unit = torch.nn.functional.normalize(histories.double(), dim=2)
    count = mask.shape[1]
    eye = torch.eye(count, dtype=torch.bool)
    pair = mask.unsqueeze(1) & mask.unsqueeze(2) & ~eye
    # like the reference code (cosine matrix minus I): the diagonal counts as 0, padding as -inf
    outside = torch.where(eye & mask.unsqueeze(2), 0.0, -float("inf")).double()
    cs = torch.where(pair, unit @ unit.transpose(1, 2), outside)
    v = cs.amax(dim=2)  # >= 0 for real senders
    v_i, v_j = v.unsqueeze(2), v.unsqueeze(1)
    pardon = pair & (v_i < v_j)
    cs = torch.where(pardon, cs * v_i / torch.where(pardon, v_j, torch.ones_like(v_j)), cs)
    alpha = (1 - cs.amax(dim=2)).clamp(0, 1)
    alpha = torch.where(mask, alpha, torch.zeros_like(alpha))
    top = alpha.amax(dim=1, keepdim=True)
    alpha = torch.where(top > 0, alpha / top.clamp_min(1e-12), alpha)
    alpha = torch.where(alpha >= 1, torch.full_like(alpha, 0.99), alpha)
    logit = kappa * (torch.log(alpha / (1 - alpha)) + 0.5)  # alpha = 0 -> -inf -> 0
    return torch.where(mask, logit.clamp(0, 1), torch.zeros_like(logit))


class FoolsGold(Defense):
    """Weight each update by FoolsGold's alpha from the senders' update histories."""

    name = "foolsgold"
    description = (
        "FoolsGold: down-weight senders whose accumulated updates are too similar (sybils)"
    )
    options = (
        Option(
            "foolsgold_kappa",
            float,
            1.0,
            "kappa, the confidence of the logit weighting",
            low=0,
            low_open=True,
        ),
    )
    uses_identities = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.kappa: float = self.option_values["foolsgold_kappa"]
        self.histories = PairMemory()

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        receivers, senders = receivers_or_default(identities, mask)
        past, _ = self.histories.gather(receivers, senders, updates.double())
        histories = past + updates.double() * mask.unsqueeze(-1)
        self.histories.put(receivers, senders, histories, mask)
        alpha = foolsgold_weights(histories, mask, self.kappa)
        kept = (alpha > 0) & mask
        kept = torch.where(kept.any(dim=1, keepdim=True), kept, mask)  # never drop everything
        alpha = torch.where(kept & (alpha > 0), alpha, kept.double())  # all dropped: plain mean
        return weighted_mean(updates, weights * alpha).to(updates.dtype), kept
