"""Equivocation: a malicious sender sends its honest model to some receivers and a poisoned
one to the others, where every receiver should get the same message (a gossip node's one
model to each neighbour, a broadcast).

Each receiver alone sees a plausible message from a sender that looks honest to half its
neighbours, so no per-receiver defense can tell; only comparing what different receivers
got does (`p4bench.engine.equivocation`, the check the round driver runs for exchanges
that `Method.identical_messages` declares). Per malicious sender and exchange, its
messages to other nodes are ordered by receiver id and the first
ceil(`equivocate_fraction` * k) of its k receivers get `equivocate_scale` times its
honest ``update.*`` payload (-1, the default: negated), the others the honest one; with
0 < fraction < 1 at least one receiver gets each, so the sender does equivocate. A
sender with a single receiver, its message to itself and a broadcast (one message: the
sender's receivers are not known here) stay honest; methods whose clients talk to a
server are refused (each client has one receiver). It needs nothing but the attacker's own messages, so a
compromised device peer mounts it as the simulator does; it draws no randomness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._honest import honest_vectors, send

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.capabilities import Capabilities
    from p4bench.rng import ClientRng

__all__ = ["Equivocate", "poisoned_receivers"]


def poisoned_receivers(messages: Messages, fraction: float) -> torch.Tensor:
    """(n,) bool: the messages that carry the poisoned model (module docstring)."""
    src, dst = messages.src, messages.dst
    away = (dst >= -1) & (dst != src)  # to another node or the server, not a broadcast
    if not bool(away.any()):
        return away
    span = int(dst.max()) + 3  # ids from -2
    # by sender, then its receivers by id, the messages it keeps honest last
    order = torch.argsort(src * (2 * span) + (~away).long() * span + (dst + 2), stable=True)
    sorted_src, sorted_away = src[order], away[order]
    first = torch.ones(len(src), dtype=torch.bool, device=src.device)
    first[1:] = sorted_src[1:] != sorted_src[:-1]
    group = torch.cumsum(first.long(), 0) - 1
    starts = first.nonzero().squeeze(1)
    rank = torch.arange(len(src), device=src.device) - starts[group]
    count = torch.zeros(len(starts), dtype=torch.long, device=src.device).index_add_(
        0, group, sorted_away.long()
    )  # receivers other than itself, per sender
    poisoned = torch.ceil(count.double() * fraction).long()
    if 0 < fraction < 1:  # each of two or more receivers' models at least once
        poisoned = poisoned.clamp(1, None).minimum(count - 1)
    poisoned = torch.where(count >= 2, poisoned, 0)  # one receiver: nothing to equivocate
    chosen = sorted_away & (rank < poisoned[group])
    out = torch.zeros_like(away)
    out[order] = chosen
    return out


class Equivocate(Attack):
    """Send some receivers the honest model and the others a poisoned (negated) one."""

    name = "equivocate"
    needs_individual_updates = True  # point-to-point messages, received one by one
    description = (
        "equivocation: each attacker sends a poisoned (negated) model to a fraction of its "
        "receivers and its honest model to the others, where all should get the same"
    )
    options = Attack.options + (
        Option(
            "equivocate_fraction",
            float,
            0.5,
            "fraction of each attacker's receivers that get the poisoned model (the first by "
            "id); the others get its honest one",
            low=0,
            high=1,
        ),
        Option(
            "equivocate_scale",
            float,
            -1.0,
            "the poisoned model is this times the honest one (-1: negated, 0: zeros)",
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.fraction: float = self.option_values["equivocate_fraction"]
        self.scale: float = self.option_values["equivocate_scale"]

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        if capabilities.uses_server:
            return (
                "it sends different receivers different models, and this method's clients "
                "talk to a server (one receiver each)"
            )
        return super().incompatibility(capabilities)

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        honest = honest_vectors(messages)
        poisoned = poisoned_receivers(messages, self.fraction).to(honest.device)
        return send(messages, torch.where(poisoned.unsqueeze(1), self.scale * honest, honest))
