"""Batched Shapley values of PDSL's candidate one-step models (Wang, Yuan, Wang, Li).

Agent a of a batch of A agents has K neighbourhood slots (padded to the same K for
all agents); ``present`` (A, K) marks its real players, its own slot among them.
Candidate j is ``x_a - lr * g[a, j]`` and a coalition S is worth the accuracy on a
shared validation set Q of ``x_a - lr * mean_{j in S} g[a, j]``, with v(empty) = 0
(Definition 3; eq. 16 leaves it undefined).

Estimators take a ``values_fn(masks (A, S, K) bool) -> (A, S) float64`` that values
coalitions (:func:`coalition_game` over :func:`coalition_values` for the real game,
anything for a synthetic one), so every agent's coalitions go through one call and
the only Python loop is over chunks of models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch.func import vmap

from p4bench.engine.state import unvectorize
from p4bench.models import Model
from p4bench_pdsl.shapley_linear import linear_coalition_values, linear_in_parameters, parents
from p4bench_pdsl.shapley_scan import SCAN_MIN_PLAYERS, linear_prefix_values

__all__ = [
    "ValuesFn",
    "linear_in_parameters",
    "coalition_values",
    "CoalitionGame",
    "coalition_game",
    "exact_shapley",
    "monte_carlo_shapley",
    "minmax_shares",
]

ValuesFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def coalition_values(
    model: Model,
    like: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    g: torch.Tensor,
    masks: torch.Tensor,
    lr: float,
    q_x: torch.Tensor,
    q_y: torch.Tensor,
    chunk: int = 128,
    q_n: torch.Tensor | None = None,
) -> torch.Tensor:
    """(A, S) float64 accuracy on (q_x, q_y) of every coalition model.

    With `q_n` (A,) the validation sets are per agent (pdsl-local-val): q_x (A, n, ...),
    q_y (A, n) padded, agent a's first q_n[a] records real; an agent without any is worth 0.

    x (A, P) flat models (``p4bench.engine.state.vectorize`` order), g (A, K, P) the
    candidates' gradients, masks (A, S, K) bool coalitions; ``like`` is a parameter dict
    with a leading axis (any length) giving the shapes for ``unvectorize``. The model of
    coalition S of agent a is ``x_a - lr * mean_{j in S} g[a, j]``; empty coalitions are
    worth 0 and are not evaluated, and a coalition repeated within an agent (Monte-Carlo
    prefixes often are) is evaluated once. ``chunk`` models share one vmapped forward.
    """
    num_agents, num_coalitions, slots = masks.shape
    if g.shape[:2] != (num_agents, slots) or x.shape != (num_agents, g.shape[2]):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, g {tuple(g.shape)}, masks {tuple(masks.shape)}"
        )
    agent, members, inverse = _distinct_coalitions(masks)
    values = torch.zeros(len(agent), dtype=torch.float64, device=masks.device)
    size = members.sum(dim=1)
    todo = torch.nonzero(size > 0).flatten()
    if linear_in_parameters(model):  # no forward per coalition (`p4bench_pdsl.shapley_linear`)
        chains = parents(agent, members, num_agents)
        values = linear_coalition_values(
            model, like, x, g, lr, q_x, q_y, q_n, agent, members, chains
        )
        return values[inverse].reshape(num_agents, num_coalitions)
    forward = vmap(
        model.forward, in_dims=(0, None) if q_n is None else (0, 0)
    )  # one Q for every model, or the agent's
    flat_g = g.reshape(num_agents * slots, -1)
    owners = agent[todo].tolist()  # one read for every chunk's span of agents
    for start in range(0, len(todo), chunk):
        rows = todo[start : start + chunk]
        owner = agent[rows]
        # Mean gradients as one matmul: each row's weights 1/|S| are placed in its agent's
        # block of slots, over only the agents this chunk spans (rows are sorted by agent).
        first, last = owners[start], owners[min(start + chunk, len(owners)) - 1] + 1
        weights = torch.zeros(len(rows), last - first, slots, dtype=g.dtype, device=g.device)
        weights[torch.arange(len(rows), device=g.device), owner - first] = members[rows].to(
            g.dtype
        ) / size[rows, None].to(g.dtype)
        mean = weights.reshape(len(rows), -1) @ flat_g[first * slots : last * slots]
        params = unvectorize(x[owner] - lr * mean, like)
        predicted = forward(params, q_x if q_n is None else q_x[owner]).argmax(dim=-1)
        if q_n is None:
            values[rows] = (predicted == q_y).double().mean(dim=1)
        else:
            real = torch.arange(q_y.shape[1], device=q_y.device) < q_n[owner, None]
            correct = (predicted == q_y[owner]) & real
            values[rows] = correct.double().sum(dim=1) / q_n[owner].clamp_min(1).double()
    return values[inverse].reshape(num_agents, num_coalitions)


def _distinct_coalitions(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(agent (U,), members (U, K), inverse (A*S,)): the distinct (agent, coalition) pairs,
    sorted by agent, and where each of the A*S input rows lies among them."""
    num_agents, num_coalitions, slots = masks.shape
    device = masks.device
    agent_of_row = torch.arange(num_agents, device=device).repeat_interleave(num_coalitions)
    flat = masks.reshape(-1, slots)
    if slots + max(num_agents, 1).bit_length() > 62:  # the packed key would overflow int64
        return agent_of_row, flat, torch.arange(len(flat), device=device)
    bits = torch.ones(slots, dtype=torch.int64, device=device) << torch.arange(slots, device=device)
    keys = (agent_of_row << slots) | (flat.long() * bits).sum(dim=1)
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    members = (unique[:, None] & bits) != 0
    return unique >> slots, members, inverse


class CoalitionGame:
    """The ``values_fn`` of PDSL's game: :func:`coalition_values` with all but the masks fixed.

    On a model linear in its parameters it also values Monte-Carlo orders' prefixes
    directly (:meth:`prefix_values`, `p4bench_pdsl.shapley_scan`), which
    :func:`monte_carlo_shapley` takes instead of building their masks."""

    def __init__(
        self,
        model: Model,
        like: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        g: torch.Tensor,
        lr: float,
        q_x: torch.Tensor,
        q_y: torch.Tensor,
        chunk: int = 128,
        q_n: torch.Tensor | None = None,
    ) -> None:
        self.model, self.like, self.x, self.g, self.lr = model, like, x, g, lr
        self.q_x, self.q_y, self.chunk, self.q_n = q_x, q_y, chunk, q_n

    def __call__(self, masks: torch.Tensor) -> torch.Tensor:
        like, x, g, q_x, q_y = self.like, self.x, self.g, self.q_x, self.q_y
        return coalition_values(
            self.model, like, x, g, masks, self.lr, q_x, q_y, chunk=self.chunk, q_n=self.q_n
        )

    def prefix_values(self, order: torch.Tensor, players: torch.Tensor) -> torch.Tensor | None:
        """(A, R, n_max + 1) float64 values of the prefixes of `order` (A, R, K) (the slot at
        each position, each agent's `players` (A,) first), or None where the masks are the
        way: a non-linear model, or neighbourhoods too small for the scan to pay
        (`SCAN_MIN_PLAYERS`)."""
        if not linear_in_parameters(self.model) or self.g.shape[:2] != order.shape[::2]:
            return None
        if not len(players) or int(players.max()) < SCAN_MIN_PLAYERS:
            return None  # few players: the masks' chained coalitions cost fewer calls
        return linear_prefix_values(
            self.like, self.x, self.g, self.lr, self.q_x, self.q_y, self.q_n, order, players
        )


def coalition_game(
    model: Model,
    like: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    q_x: torch.Tensor,
    q_y: torch.Tensor,
    chunk: int = 128,
    q_n: torch.Tensor | None = None,
) -> CoalitionGame:
    """PDSL's game (:class:`CoalitionGame`), a ``values_fn``."""
    return CoalitionGame(model, like, x, g, lr, q_x, q_y, chunk, q_n)


def _ranks(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank (A, K): index of each present slot among its agent's players, -1 if absent;
    n (A,): number of players)."""
    present = present.bool()
    rank = torch.where(
        present, present.long().cumsum(dim=1) - 1, torch.full_like(present, -1, dtype=torch.long)
    )
    return rank, present.sum(dim=1)


def exact_shapley(
    values_fn: ValuesFn, present: torch.Tensor, max_players: int = 16
) -> torch.Tensor:
    """(A, K) float64 exact Shapley values; absent slots get 0.

    Agent a's n_a players are numbered by slot order and subset b (an integer < 2^n_a)
    holds player r when bit r is set; one ``values_fn`` call values 2^n_max subsets per
    agent (those with players beyond n_a are passed as empty and not used). Then
    phi_j = sum_{S not holding j} |S|! (n - |S| - 1)! / n! [v(S + j) - v(S)].
    """
    if present.ndim != 2:
        raise ValueError(f"present must be (agents, slots), got shape {tuple(present.shape)}")
    rank, n = _ranks(present)
    num_agents, slots = present.shape
    n_max = int(n.max()) if num_agents else 0
    if n_max > max_players:
        raise ValueError(
            f"exact Shapley over {n_max} players needs 2^{n_max} coalitions (max_players={max_players})"
        )
    device = present.device
    if n_max == 0:
        return torch.zeros(num_agents, slots, dtype=torch.float64, device=device)
    subsets = torch.arange(2**n_max, device=device)
    holds = ((subsets[:, None] >> torch.arange(n_max, device=device)) & 1).bool()  # (B, n_max)
    valid = subsets[None, :] < (1 << n)[:, None]  # (A, B): no player beyond n_a
    masks = holds[:, rank.clamp_min(0)].permute(1, 0, 2) & present[:, None, :] & valid[:, :, None]
    values = values_fn(masks).double()  # (A, B)

    # Subsets without player r: the numbers 0..2^(n_max-1)-1 with a 0 bit inserted at r.
    players = torch.arange(n_max, device=device)[:, None]
    c = torch.arange(2 ** (n_max - 1), device=device)[None, :]
    without = ((c >> players) << (players + 1)) | (c & ((1 << players) - 1))  # (n_max, B/2)
    gain = values[:, without | (1 << players)] - values[:, without]  # (A, n_max, B/2)
    size = holds.sum(dim=1)[without]  # (n_max, B/2)
    factorial = torch.tensor(
        [math.factorial(k) for k in range(n_max + 1)], dtype=torch.float64, device=device
    )
    rest = (n[:, None, None] - size[None] - 1).clamp_min(0)
    weight = factorial[size][None] * factorial[rest] / factorial[n][:, None, None]
    weight = weight * valid[:, without] * (players[None] < n[:, None, None])
    phi_by_rank = (weight * gain).sum(dim=2)  # (A, n_max)
    return _by_slot(phi_by_rank, rank)


def _by_slot(by_rank: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """(A, K) from per-player values (A, n_max): slot k gets its player's value, 0 if absent."""
    picked = by_rank.gather(1, rank.clamp(0, by_rank.shape[1] - 1))
    return torch.where(rank >= 0, picked, torch.zeros_like(picked))


def monte_carlo_shapley(
    values_fn: ValuesFn,
    present: torch.Tensor,
    R: int,
    generator: torch.Generator | None = None,
    *,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """(A, K) float64 Monte-Carlo Shapley values (Castro et al. 2009; PDSL's Alg. 2).

    R random orders of each agent's present players: the argsort of uniform keys (A, R, K),
    drawn from ``generator`` or given as ``keys`` (e.g. from per-agent streams, so an
    agent's orders do not depend on the batch it is in), absent slots pushed last. The
    n_max + 1 prefixes of all orders of all agents, (A, R * (n_max + 1), K), go through
    one ``values_fn`` call (prefixes longer than n_a are passed as empty and not used),
    and a player's marginal contributions v(prefix + j) - v(prefix) are averaged over
    the R orders. Absent slots get 0.
    """
    if R < 1:
        raise ValueError(f"R must be >= 1, got {R}")
    if (generator is None) == (keys is None):
        raise ValueError("give exactly one of generator and keys")
    present = present.bool()
    num_agents, slots = present.shape
    n = present.sum(dim=1)
    n_max = int(n.max()) if num_agents else 0
    if n_max == 0:
        return torch.zeros(num_agents, slots, dtype=torch.float64, device=present.device)
    if keys is None:
        assert generator is not None
        keys = torch.rand(
            num_agents, R, slots, generator=generator, dtype=torch.float64, device=generator.device
        )
    elif keys.shape != (num_agents, R, slots):
        raise ValueError(
            f"keys must be (agents, R, slots) = {(num_agents, R, slots)}, got {tuple(keys.shape)}"
        )
    keys = keys.to(present.device, torch.float64).masked_fill(
        ~present[:, None, :], 2.0
    )  # uniform keys are < 2
    order = keys.argsort(dim=2)  # (A, R, K): the slot at each position of order r
    position = order.argsort(dim=2)  # (A, R, K): where slot k comes in order r
    values = (
        values_fn.prefix_values(order, n) if isinstance(values_fn, CoalitionGame) else None
    )  # a linear model's game values the orders' prefixes directly (`shapley_scan`)
    if values is None:
        length = torch.arange(n_max + 1, device=present.device)
        masks = (position[:, :, None, :] < length[None, None, :, None]) & present[:, None, None, :]
        masks &= (length[None, :] <= n[:, None])[:, None, :, None]
        values = values_fn(masks.reshape(num_agents, R * (n_max + 1), slots)).double()
        values = values.reshape(num_agents, R, n_max + 1)
    gain = (
        values[:, :, 1:] - values[:, :, :-1]
    )  # (A, R, n_max): gain of the player at each position
    phi = gain.gather(2, position.clamp_max(n_max - 1)).mean(dim=1)
    return torch.where(present, phi, torch.zeros_like(phi))


def minmax_shares(
    phi: torch.Tensor, present: torch.Tensor, atol: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PDSL's min-max normalisation over each agent's present players.

    Returns (phi_hat, shares, fallback): ``phi_hat = (phi - min) / (max - min)`` (so the
    worst player always gets 0), ``shares = phi_hat / sum(phi_hat)``, and ``fallback``
    (A,) bool where max - min <= atol (all players equal, within rounding): there
    phi_hat is 1 and the shares are uniform 1/n. Absent slots get 0 in both. Otherwise
    the best player has phi_hat = 1, so the sum is never 0.
    """
    present = present.bool()
    phi = phi.double()
    high = phi.masked_fill(~present, -math.inf).amax(dim=1, keepdim=True)
    low = phi.masked_fill(~present, math.inf).amin(dim=1, keepdim=True)
    span = high - low
    fallback = ~(span > atol)  # also agents without players (span NaN)
    scaled = (phi - low) / torch.where(fallback, torch.ones_like(span), span)
    phi_hat = torch.where(
        present, torch.where(fallback, torch.ones_like(phi), scaled), torch.zeros_like(phi)
    )
    shares = phi_hat / phi_hat.sum(dim=1, keepdim=True).clamp_min(1e-300)
    return phi_hat, shares, fallback.squeeze(1)
