"""The dissensus attack (He, Karimireddy and Jaggi 2022, "Byzantine-robust decentralized
learning via ClippedGossip" / self-centered clipping, arXiv 2202.01545).

Against gossip averaging, every Byzantine neighbour b of an honest node i sends i

    x_b->i = x_i - eps * sum_{j in N_i honest} W_ij (x_j - x_i) / sum_{b' in N_i Byzantine} W_ib'

so that plain mixing gives x_i + (1 - eps) sum_j W_ij (x_j - x_i): with eps > 1 node i
moves *away* from its honest neighbours (eps = 1 cancels their pull, eps < 1 slows it).
Few attackers on a bottleneck of the graph keep the honest nodes from agreeing.
Option `dissensus_epsilon` (default 1.5, the value of the authors' experiments,
``dissensus1.5`` in their code).

Messages are per receiver: gossip methods send one point-to-point message per
neighbour (`p4bench.engine.messages.Messages` addresses each message to one
destination), so every Byzantine node sends each honest neighbour the model crafted for
it, as in the paper. x_i, x_j and W_ij are what the attackers read from the exchange
(`p4bench_attacks._gossip`: the honest messages, the graph, the run's ``mixing`` rule);
the authors' code likewise reads the target's mixing weights. Differences from it: their
code lets each Byzantine node target one honest neighbour; here each targets every honest
neighbour it has. Messages to another attacker, to itself, to the server or broadcasts
stay honest, and so does everything without observed messages (a lone node on a device,
which cannot see its neighbours' models). Only ``update.*`` payloads change (DP-DSGT's
tracker rides along honestly). The crafted model is the attacker's own message: with DP
on it is sent as crafted (DP-DSGD, DP-DSGT and Muffliato noise gradients, not messages).
Omniscient; deterministic (it draws no randomness).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._gossip import MIXING_OPTION, gossip_view
from p4bench_attacks._honest import honest_vectors, send

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.capabilities import Capabilities
    from p4bench.rng import ClientRng


def gossip_incompatibility(capabilities: Capabilities) -> str | None:
    """Why a gossip attack cannot target a method: it needs peers that mix the models
    their neighbours send (an aggregator, no server)."""
    if capabilities.uses_server:
        return (
            "it crafts a model per gossip neighbour from the receiver's own model, and this "
            "method's clients talk to a server"
        )
    if not (capabilities.has_aggregator and capabilities.shares_individual_updates):
        return (
            "it targets gossip averaging, and in this method no peer mixes its neighbours' models"
        )
    return None


class Dissensus(Attack):
    """Send each honest neighbour i: x_i - eps * (its honest neighbours' pull) / (Byzantine weight)."""

    name = "dissensus"
    description = (
        "dissensus (He, Karimireddy & Jaggi 2022): Byzantine gossip neighbours send each honest "
        "node a model that pushes it away from its honest neighbours (gossip methods)"
    )
    options = Attack.options + (
        MIXING_OPTION,
        Option(
            "dissensus_epsilon",
            float,
            1.5,
            "eps: an attacked node moves by (1 - eps) times its honest neighbours' pull "
            "(eps > 1: away from them)",
            low=0,
        ),
    )
    omniscient = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.epsilon: float = self.option_values["dissensus_epsilon"]
        self.mixing: str = self.option_values["mixing"]

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        return super().incompatibility(capabilities) or gossip_incompatibility(capabilities)

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
        view = gossip_view(messages, observed, colluding, self.mixing)
        if view is None:
            return messages
        target = view.targets(messages)
        at = messages.dst.clamp(0, view.nodes - 1)
        push = view.pull() / view.byzantine_mass.clamp_min(1e-300).unsqueeze(1)
        crafted = view.models[at] - self.epsilon * push[at]
        out = torch.where(target.unsqueeze(1), crafted, honest.double())
        return send(messages, out.to(honest.dtype))
