"""`spectral`: Byzantine gossip neighbours excite the honest graph's slowest-mixing mode.

Motivated by the breakdown analysis of Gaucher, Dieuleveut and Hendrikx (ICML 2025,
"Unified breakdown analysis for Byzantine robust gossip"), whose attack exploits the
spectral structure of the communication graph; this is the suite's own construction
along those lines, not a reproduction of theirs. Every Byzantine neighbour b of an
honest node i sends i

    x_b->i = x_i + s_i * eps * v_i * d

- v: the Fiedler vector of the honest subgraph's Laplacian L = D - A (A: the honest
  nodes and the edges among them, unweighted and symmetrised), scaled to max |v_i| = 1.
  It is the eigenvector of L's second-smallest eigenvalue, the direction in which gossip
  among the honest nodes averages out slowest, and it sums to 0, so the push splits the
  honest nodes into two camps without moving their average (for a doubly stochastic W).
  Where that eigenvalue is repeated (a ring, a torus) the vector is the projection of
  the fixed ramp (-1 .. 1 over the honest ids in order) onto its eigenspace, so the
  choice does not depend on the eigensolver. A disconnected honest subgraph gives an
  eigenvalue 0 and a vector constant on each part: the parts are pushed apart for good.
  Computed once per graph (cached) from the exchange's messages, which are the method's
  public topology (`p4bench_attacks._gossip`).
- d: a unit direction in parameter space, option `spectral_direction`: ``random``
  (default), a fixed random unit vector drawn once from the run seed (shared by all
  attackers, the same in every runtime); ``mean-sign``, sign(mean of the honest models)
  normalised, recomputed at each exchange.
- s_i, option `spectral_scale`: ``spread`` (default), the distance from x_i to its
  farthest honest neighbour, so that with eps <= 1 the crafted model lies no farther
  from x_i than an honest neighbour does and passes self-centred clipping (ClippedGossip)
  and distance filters whose radius admits the honest neighbours; ``absolute``: 1 (eps
  is then the perturbation's norm at the Fiedler vector's extremes).
- eps: option `spectral_epsilon` (default 1).

x_i is the receiver's own model as read from the exchange. Messages to another attacker,
to itself, to the server or broadcasts stay honest, and so does everything without
observed messages (a lone node on a device). With DP on the crafted model is sent as is
(the gossip methods noise gradients, not messages). Omniscient; deterministic given the
run seed (the `rng` streams are not used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from p4bench.engine import Attack, Messages
from p4bench.options import Option
from p4bench_attacks._gossip import GossipView, gossip_view
from p4bench_attacks._honest import honest_vectors, send
from p4bench_attacks.dissensus import gossip_incompatibility

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.capabilities import Capabilities
    from p4bench.rng import ClientRng

DIRECTIONS = ("random", "mean-sign")
SCALES = ("spread", "absolute")
SEED_SPECTRAL = 0x5EC7  # the public stream of the random direction, mixed with the run seed
_CACHED_GRAPHS = 8


def fiedler_vector(
    nodes: int, honest: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> torch.Tensor:
    """(nodes,) float64: the Fiedler vector of the graph on the `honest` (H,) ids with
    edges src -> dst (symmetrised; ids outside `honest` ignored), max |v| = 1, 0 off it."""
    ids = honest.cpu().numpy()
    out = np.zeros(nodes)
    if len(ids) < 2:
        return torch.from_numpy(out)
    position = np.full(nodes, -1)
    position[ids] = np.arange(len(ids))
    a, b = position[src.cpu().numpy()], position[dst.cpu().numpy()]
    inside = (a >= 0) & (b >= 0) & (a != b)
    adjacency = np.zeros((len(ids), len(ids)))
    adjacency[a[inside], b[inside]] = 1.0
    adjacency = np.maximum(adjacency, adjacency.T)
    laplacian = np.diag(adjacency.sum(axis=1)) - adjacency
    values, vectors = np.linalg.eigh(laplacian)
    tolerance = 1e-9 * max(1.0, float(values[-1]))
    space = vectors[:, np.abs(values - values[1]) <= tolerance]
    ramp = np.linspace(-1.0, 1.0, len(ids))
    v = space @ (space.T @ ramp)
    if np.abs(v).max() < 1e-9:  # the ramp misses the eigenspace: its first vector, sign fixed
        v = space[:, 0] * np.sign(space[np.argmax(np.abs(space[:, 0])), 0])
    out[ids] = v / np.abs(v).max()
    return torch.from_numpy(out)


class Spectral(Attack):
    """Send each honest neighbour i: x_i + s_i * eps * v_i * d (v: the honest graph's Fiedler vector)."""

    name = "spectral"
    description = (
        "spectral: Byzantine gossip neighbours push honest nodes along the honest graph's "
        "slowest-mixing (Fiedler) vector, scaled to pass clipping (gossip methods)"
    )
    options = Attack.options + (
        Option(
            "spectral_epsilon",
            float,
            1.0,
            "eps: size of the push, in units of spectral_scale",
            low=0,
        ),
        Option(
            "spectral_direction",
            str,
            "random",
            "direction d in parameter space: a fixed random unit vector from the run seed, "
            "or the sign of the honest mean model",
            choices=DIRECTIONS,
        ),
        Option(
            "spectral_scale",
            str,
            "spread",
            "spread: relative to the receiver's farthest honest neighbour (passes clipping "
            "for eps <= 1); absolute: eps in parameter units",
            choices=SCALES,
        ),
    )
    omniscient = True

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.epsilon: float = self.option_values["spectral_epsilon"]
        self.direction: str = self.option_values["spectral_direction"]
        self.scale: str = self.option_values["spectral_scale"]
        self._fiedler: dict[bytes, torch.Tensor] = {}
        self._random: dict[int, torch.Tensor] = {}

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        return super().incompatibility(capabilities) or gossip_incompatibility(capabilities)

    def fiedler(self, view: GossipView) -> torch.Tensor:
        """(M,) the Fiedler vector of the honest subgraph of this exchange (cached per graph)."""
        honest = view.honest.nonzero().squeeze(1)
        edges = view.honest_src * view.nodes + view.honest_dst
        key = (
            np.asarray([view.nodes, len(honest)], dtype=np.int64).tobytes()
            + torch.cat([honest, torch.unique(edges)]).cpu().numpy().tobytes()
        )
        if key not in self._fiedler:
            if len(self._fiedler) >= _CACHED_GRAPHS:
                self._fiedler.clear()
            self._fiedler[key] = fiedler_vector(
                view.nodes, honest, view.honest_src, view.honest_dst
            )
        return self._fiedler[key].to(view.models.device)

    def unit_direction(self, view: GossipView) -> torch.Tensor:
        """(P,) float64 unit direction d."""
        size = view.models.shape[1]
        if self.direction == "mean-sign":
            mean = view.models[view.known].mean(dim=0)
            sign = torch.sign(mean)
            norm: torch.Tensor = sign.norm()  # Tensor.norm is untyped
            return sign / norm.clamp_min(1e-12)
        if size not in self._random:
            stream = np.random.default_rng(
                np.random.SeedSequence([self.config.seed, SEED_SPECTRAL])
            )
            draw = stream.standard_normal(size)
            self._random[size] = torch.from_numpy(draw / np.linalg.norm(draw))
        return self._random[size].to(view.models.device)

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
        view = gossip_view(messages, observed, colluding)  # W's values do not enter
        if view is None:
            return messages
        target = view.targets(messages)
        at = messages.dst.clamp(0, view.nodes - 1)
        size = self.epsilon * self.fiedler(view)
        if self.scale == "spread":
            size = size * view.farthest()
        push = size.unsqueeze(1) * self.unit_direction(view).unsqueeze(0)
        crafted = view.models[at] + push[at]
        out = torch.where(target.unsqueeze(1), crafted, honest.double())
        return send(messages, out.to(honest.dtype))
