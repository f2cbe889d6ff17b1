"""The views of a gossip run as linear maps of its releases (`p4bench.privacy.network_dp`).

`build_views` replays the events once on symbolic states: a state is a row over the run's
releases (N x n), a `Release` adds sigma_r to its own column (the release in whitened
units, so that every release's noise is standard), a `Gossip` records the states every
node hears and mixes them. `coalition_sensitivity` stacks what a coalition hears (and its
own releases, which it knows), projects onto that row space and bounds, for every node
u, the largest whitened shift one record of u can make in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from p4bench.errors import ConfigError
from p4bench.privacy.network_events import Gossip, NetworkEvent, Release

__all__ = ["NetworkViews", "build_views", "coalition_gram", "coalition_sensitivity", "view_matrix"]


@dataclass(frozen=True)
class NetworkViews:
    """Everything any node can observe, as linear maps of the whitened releases.

    Attributes:
        num_nodes: N.
        owner: (n,) the node of each release.
        shift: (n,) 1 / sigma_r: the largest whitened move one record makes in release r
            (inf for a noiseless release).
        snapshots: per gossip step, the (N, n_t) states that are sent (n_t: releases so far).
        senders: per gossip step, per node v, the nodes v hears (v excluded).
        release_index: (N, n_max) each node's releases, padded with -1.
        rate: (n,) the Poisson rate of each release (1: every record takes part).
    """

    num_nodes: int
    owner: np.ndarray
    shift: np.ndarray
    snapshots: tuple[np.ndarray, ...]
    senders: tuple[tuple[np.ndarray, ...], ...]
    release_index: np.ndarray
    rate: np.ndarray

    @property
    def num_releases(self) -> int:
        return int(self.owner.size)


def _release_mask(event: Release, num_nodes: int, position: int) -> tuple[np.ndarray, float, float]:
    mask = np.asarray(event.nodes)
    if mask.shape != (num_nodes,):
        raise ConfigError(
            f"events[{position}].nodes", f"must be ({num_nodes},) booleans, got {mask.shape}"
        )
    sigma = float(event.noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ConfigError(
            f"events[{position}].noise_multiplier", f"must be finite and >= 0, got {sigma}"
        )
    rate = float(event.sample_rate)
    if not 0.0 < rate <= 1.0:
        raise ConfigError(f"events[{position}].sample_rate", f"must be in (0, 1], got {rate}")
    return mask.astype(bool), sigma, rate


def _weights(event: Gossip, num_nodes: int, position: int) -> np.ndarray:
    weights = np.asarray(event.weights, dtype=float)
    if weights.shape != (num_nodes, num_nodes) or not np.all(np.isfinite(weights)):
        raise ConfigError(
            f"events[{position}].weights",
            f"must be a finite ({num_nodes}, {num_nodes}) matrix, got shape {weights.shape}",
        )
    return weights


def _mix(weights: np.ndarray, states: np.ndarray) -> np.ndarray:
    """weights @ states; sparse when the graph is (a ring mixes 3 of N states per row)."""
    if np.count_nonzero(weights) > 0.25 * weights.size:
        dense: np.ndarray = weights @ states
        return dense
    from scipy.sparse import csr_array

    mixed: np.ndarray = csr_array(weights) @ states
    return mixed


def build_views(events: Sequence[NetworkEvent], num_nodes: int) -> NetworkViews:
    """Replay `events` on symbolic states (module docstring)."""
    checked: list[tuple[str, np.ndarray, float, float]] = []
    for position, event in enumerate(events):
        if isinstance(event, Release):
            mask, sigma, rate = _release_mask(event, num_nodes, position)
            checked.append(("release", mask, sigma, rate))
        elif isinstance(event, Gossip):
            checked.append(("gossip", _weights(event, num_nodes, position), 0.0, 1.0))
        else:
            raise ConfigError(
                f"events[{position}]", f"must be a Release or a Gossip, got {event!r}"
            )
    total = sum(int(item.sum()) for kind, item, _, _ in checked if kind == "release")
    state = np.zeros((num_nodes, total))
    owner: list[int] = []
    shift: list[float] = []
    rates: list[float] = []
    snapshots: list[np.ndarray] = []
    senders: list[tuple[np.ndarray, ...]] = []
    released = 0
    for kind, item, sigma, rate in checked:
        if kind == "release":
            nodes = np.flatnonzero(item)
            columns = released + np.arange(nodes.size)
            # whitened: release = sigma (g / sigma + z); a noiseless release keeps scale 1
            # and an infinite shift, so any view that sees it is told so (mu = inf)
            state[nodes, columns] += sigma if sigma > 0 else 1.0
            owner.extend(int(w) for w in nodes)
            shift.extend([1.0 / sigma if sigma > 0 else math.inf] * nodes.size)
            rates.extend([rate] * nodes.size)
            released += nodes.size
        else:
            hears = item != 0
            np.fill_diagonal(hears, False)
            if hears.any():  # a diagonal "gossip" only rescales states: nothing is sent
                snapshots.append(state[:, :released].copy())
                senders.append(tuple(np.flatnonzero(row) for row in hears))
            state[:, :released] = _mix(item, state[:, :released])
    owner_array = np.asarray(owner, dtype=np.int64)
    counts = np.bincount(owner_array, minlength=num_nodes) if owner else np.zeros(num_nodes, int)
    index = np.full((num_nodes, max(1, int(counts.max(initial=0)))), -1, dtype=np.int64)
    for node in range(num_nodes):
        mine = np.flatnonzero(owner_array == node)
        index[node, : mine.size] = mine
    return NetworkViews(
        num_nodes=num_nodes,
        owner=owner_array,
        shift=np.asarray(shift, dtype=float),
        snapshots=tuple(snapshots),
        senders=tuple(senders),
        release_index=index,
        rate=np.asarray(rates, dtype=float),
    )


def view_matrix(views: NetworkViews, coalition: Sequence[int]) -> np.ndarray:
    """(m, n): one row per message a member hears from outside the coalition (members'
    states are linear in what they heard and released) and one per member's release."""
    members = np.asarray(sorted(set(int(w) for w in coalition)), dtype=np.int64)
    n = views.num_releases
    blocks: list[np.ndarray] = []
    for snapshot, heard in zip(views.snapshots, views.senders, strict=True):
        sources = np.setdiff1d(np.concatenate([heard[v] for v in members]), members)
        if sources.size and snapshot.shape[1]:
            block = np.zeros((sources.size, n))
            block[:, : snapshot.shape[1]] = snapshot[sources]
            blocks.append(block)
    own = np.flatnonzero(np.isin(views.owner, members))
    if own.size:
        unit = np.zeros((own.size, n))
        unit[np.arange(own.size), own] = 1.0
        blocks.append(unit)
    return np.vstack(blocks) if blocks else np.zeros((0, n))


def _row_space(matrix: np.ndarray) -> np.ndarray:
    """(n, r) orthonormal basis of the row space (numpy's default rank tolerance).

    A QR factorisation first (backward stable, the same singular values) reduces the SVD to
    the small side: a view has far fewer messages than the run has releases, or the reverse
    on dense graphs.
    """
    rows, columns = matrix.shape
    if matrix.size == 0:
        return np.zeros((columns, 0))
    if rows < columns:  # M^T = Q R = (Q U) S V^T: the row space of M is spanned by Q U
        q, r = np.linalg.qr(matrix.T)
        left, singular, _ = np.linalg.svd(r)
        tolerance = singular.max(initial=0.0) * max(rows, columns) * np.finfo(float).eps
        basis: np.ndarray = q @ left[:, singular > tolerance]
        return basis
    _, r = np.linalg.qr(matrix)  # M = Q R: M and R have the same row space
    _, singular, right = np.linalg.svd(r)
    tolerance = singular.max(initial=0.0) * max(rows, columns) * np.finfo(float).eps
    spanned: np.ndarray = right[singular > tolerance].T
    return spanned


def coalition_sensitivity(views: NetworkViews, coalition: Sequence[int]) -> np.ndarray:
    """(N,) mu^2(u -> coalition) for every u; entries of members are meaningless (0 is
    put there by callers). See `p4bench.privacy.network_dp` for the bound."""
    return coalition_gram(views, coalition)[0]


def coalition_gram(views: NetworkViews, coalition: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(mu^2 as `coalition_sensitivity`, (N, n_max, n_max) D^-1 P D^-1 on each node's
    releases in the coalition's view; padding rows and columns are zero)."""
    n_nodes, n = views.num_nodes, views.num_releases
    if n == 0:
        return np.zeros(n_nodes), np.zeros((n_nodes, 1, 1))
    matrix = view_matrix(views, coalition)
    # releases the view never touches (exact zeros: gossip spreads one hop per step) have no
    # component in its row space; dropping them shrinks the factorisation on sparse graphs
    touched = np.flatnonzero(np.abs(matrix).max(axis=0, initial=0.0) > 0)
    basis = np.zeros((n, 0))
    if touched.size:
        reduced = _row_space(matrix[:, touched])
        basis = np.zeros((n, reduced.shape[1]))
        basis[touched] = reduced
    finite_shift = np.where(np.isfinite(views.shift), views.shift, 0.0)
    padded = np.vstack([basis * finite_shift[:, None], np.zeros((1, basis.shape[1]))])
    per_node = padded[views.release_index]  # (N, n_max, r); index -1 is the zero row
    gram = per_node @ per_node.transpose(0, 2, 1)  # D^-1 P D^-1 on each node's releases
    absolute = np.abs(gram).sum(axis=(1, 2))
    counts = (views.release_index >= 0).sum(axis=1)
    spectral = counts * np.linalg.eigvalsh(gram)[:, -1]
    seen_all = np.bincount(views.owner, weights=finite_shift**2, minlength=n_nodes)
    mu2: np.ndarray = np.minimum(np.minimum(absolute, np.maximum(spectral, 0.0)), seen_all)
    # a noiseless release of u that reaches the view in any way exposes u's record
    noiseless = ~np.isfinite(views.shift)
    if noiseless.any() and matrix.size:
        visible = noiseless & (np.abs(matrix).max(axis=0) > 0)
        mu2[np.unique(views.owner[visible])] = math.inf
    return mu2, gram
