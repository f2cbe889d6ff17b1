"""What colluding attackers know about one gossip exchange, per receiver.

Gossip attacks (`dissensus`, `spectral`) craft a different model for each honest
neighbour i from i's own model x_i, its honest neighbours' models x_j and the mixing
weights W_ij it applies. Methods that gossip (DP-DSGD, DP-DSGT, Muffliato) send each
neighbour, and themselves (W's diagonal), one point-to-point message whose ``update.*``
payload is the sender's model, so in the batched simulator the attackers learn it all
from the exchange itself (the omniscient knowledge of `p4bench.engine.threats`):

- x_i: what honest node i sends, taken from its message to itself where there is one,
  else from its message to its lowest-numbered neighbour (a gossiping node sends every
  neighbour the same model);
- the graph of the exchange: every (sender, receiver) pair of the honest (`observed`),
  colluding and own messages, which is the method's public topology for this exchange
  (a time-varying graph is read anew at each exchange);
- W_ij (dissensus only): rebuilt from that graph with the run's ``mixing`` option
  (DP-DSGD's, DP-DSGT's and Muffliato's, which `dissensus` declares as well; metropolis by
  default): metropolis W_ij = 1 / (1 + max(deg_i, deg_j)), uniform W_ij = 1 / (1 +
  indeg_i), deg counting distinct neighbours (self excluded). Only ratios of a receiver's
  weights enter the attack, so any rule that weighs a receiver's neighbours equally
  (uniform; metropolis on a regular graph) gives the same crafted models. DP-DSGT's
  ``mixing_order=sequential`` mixes with another matrix (A = S(D + U)); there the weights
  are W's, an approximation.

Without observed messages (one node per process on a device) nothing of this is known
and the attacks send their honest messages unchanged. Everything here is batched over
messages (index_add / scatter): no loop over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p4bench.engine.messages import Messages, update_keys
from p4bench.engine.threats import update_vectors
from p4bench.options import Option

MIXINGS = ("metropolis", "uniform")
# the gossip methods' own option (DP-DSGD, DP-DSGT, Muffliato), declared by dissensus too:
# one `-o mixing=...` reaches the method and the attack, so both mix with the same rule
MIXING_OPTION = Option(
    "mixing",
    str,
    "metropolis",
    "mixing matrix W the attackers assume the receivers mix with (the gossip methods' own "
    "option): metropolis (1/(1+max(deg_i, deg_j))) or uniform (1/(1+indeg_i))",
    choices=MIXINGS,
)


@dataclass
class GossipView:
    """One exchange as the attackers see it (node ids index the (M, ...) tensors).

    `models` (M, P) float64: each honest node's own model x_i, where `known` (M,);
    `honest_src`, `honest_dst` (E,), `honest_weight` (E,) and `honest_models` (E, P):
    the honest messages between distinct nodes with their W_ij; `byzantine_mass` (M,):
    sum of W_ib over the malicious senders b of each receiver; `honest` (M,) bool: the
    nodes that sent an honest message.
    """

    models: torch.Tensor
    known: torch.Tensor
    honest: torch.Tensor
    honest_src: torch.Tensor
    honest_dst: torch.Tensor
    honest_weight: torch.Tensor
    honest_models: torch.Tensor
    byzantine_mass: torch.Tensor

    @property
    def nodes(self) -> int:
        return int(self.known.shape[0])

    def targets(self, messages: Messages) -> torch.Tensor:
        """(n,) bool: the malicious messages worth crafting: to another node whose model
        is known (an honest receiver) that hears at least one malicious neighbour."""
        dst = messages.dst
        inside = (dst >= 0) & (dst < self.nodes)
        at = dst.clamp(0, max(self.nodes - 1, 0))
        if not self.nodes:
            return torch.zeros_like(inside)
        return inside & (dst != messages.src) & self.known[at] & (self.byzantine_mass[at] > 0)

    def receiver_sum(self, values: torch.Tensor) -> torch.Tensor:
        """(M, ...) sum over each receiver's honest in-edges of `values` (E, ...)."""
        out = values.new_zeros((self.nodes, *values.shape[1:]))
        return out.index_add_(0, self.honest_dst, values)

    def pull(self) -> torch.Tensor:
        """(M, P) sum_j W_ij (x_j - x_i) over each receiver i's honest neighbours j."""
        gap = self.honest_models - self.models[self.honest_dst]
        return self.receiver_sum(self.honest_weight.unsqueeze(1) * gap)

    def farthest(self) -> torch.Tensor:
        """(M,) max_j ||x_j - x_i|| over each receiver i's honest neighbours (0: none)."""
        gap = self.honest_models - self.models[self.honest_dst]
        norms: torch.Tensor = gap.norm(dim=1)  # Tensor.norm is untyped
        out = torch.zeros(self.nodes, dtype=norms.dtype)
        return out.scatter_reduce_(0, self.honest_dst, norms, reduce="amax", include_self=True)


def _updates(messages: Messages | None) -> Messages:
    if messages is None or not len(messages):
        return Messages.empty()
    keys = update_keys(messages.payload)
    return Messages(messages.src, messages.dst, {k: messages.value(k) for k in keys})


def gossip_view(
    messages: Messages,
    observed: Messages | None,
    colluding: Messages | None,
    mixing: str = "metropolis",
) -> GossipView | None:
    """The view of one exchange from the malicious `messages`, the `observed` honest ones
    and the `colluding` attackers' (module docstring); None when no honest message is
    known."""
    honest = _updates(observed)
    if not len(honest):
        return None
    malicious = Messages.concat([_updates(messages), _updates(colluding)])
    everyone = torch.cat([honest.src, honest.dst, malicious.src, malicious.dst])
    nodes = int(everyone.max()) + 1
    vectors = update_vectors(honest.payload).double()

    # x_i: a node's message to itself first, then the lowest receiver (one row per node)
    own = (honest.src >= 0) & (honest.dst >= 0)
    src, dst, rows = honest.src[own], honest.dst[own], own.nonzero().squeeze(1)
    order = torch.argsort((src * 2 + (src != dst).long()) * nodes + dst.clamp_min(0), stable=True)
    src, rows = src[order], rows[order]
    first = torch.ones_like(src, dtype=torch.bool)
    first[1:] = src[1:] != src[:-1]
    models = vectors.new_zeros(nodes, vectors.shape[1])
    models[src[first]] = vectors[rows[first]]
    known = torch.zeros(nodes, dtype=torch.bool)
    known[src[first]] = True
    sent = torch.zeros(nodes, dtype=torch.bool)
    sent[honest.src[honest.src >= 0]] = True

    # the graph: distinct (sender, receiver) pairs between distinct nodes
    src_all = torch.cat([honest.src, malicious.src])
    dst_all = torch.cat([honest.dst, malicious.dst])
    edge = (src_all >= 0) & (dst_all >= 0) & (src_all != dst_all)
    pairs = torch.unique(src_all[edge] * nodes + dst_all[edge])
    degree = torch.bincount(pairs % nodes, minlength=nodes).double()

    def weight(s: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        if mixing == "uniform":
            return 1.0 / (1.0 + degree[d])
        return 1.0 / (1.0 + torch.maximum(degree[d], degree[s]))

    between = own & (honest.src != honest.dst)
    h_src, h_dst = honest.src[between], honest.dst[between]
    bad = (malicious.src >= 0) & (malicious.dst >= 0) & (malicious.src != malicious.dst)
    b_src, b_dst = malicious.src[bad], malicious.dst[bad]
    mass = torch.zeros(nodes, dtype=torch.float64).index_add_(0, b_dst, weight(b_src, b_dst))
    return GossipView(
        models=models,
        known=known,
        honest=sent,
        honest_src=h_src,
        honest_dst=h_dst,
        honest_weight=weight(h_src, h_dst),
        honest_models=vectors[between],
        byzantine_mass=mass,
    )
