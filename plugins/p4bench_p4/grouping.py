"""P4's group formation (Algorithm 1) as a pure function of the sampled dissimilarities.

Every client runs this on the same shared measurements and the same public random
stream, so all clients agree on the groups without a coordinator.

Rounds of pairing, first on clients, then on merged groups (paper, steps 2-3): the most
similar pairs are merged first (mutual best pairs, then greedily the most similar pair
left), the rest at random. Members pool their measurements: two groups' dissimilarity is
the smallest known one across them (the paper's "maximum similarity between any of its
members"). np.inf (or any negative value) means "not measured"; a pair is known if either
end measured it.

Any target size V. The paper's loop only doubles (1, 2, 4, ...), which reaches V only for
powers of two. Here V is built from its binary pieces (`merge_plan`): doubling rounds
k = 1..floor(log2 V) merge units of size 2^(k-1) in pairs, then assembly rounds join the
pieces, largest first (V = 7: 1+1 -> 2, 2+2 -> 4, then 4+2 -> 6, 6+1 -> 7). Each round
merges exactly the planned number of pairs of one size type. The plan fixes the sizes,
whatever the measurements; the similarities decide who goes with whom: the most
similar pairs of that type first, then random ones where too few pairs are known.

[choice] Greedy order: the paper's greedy step walks clients in index order. Here pairs
are taken in order of dissimilarity (ties: lower index first), which is what repeatedly
taking mutual best pairs among the unassigned gives. When a round pairs every unit, as
the paper's rounds do, its pairs include all the paper's mutual-best pairs. The result
does not depend on how clients are numbered, and a round with a quota keeps its most
similar pairs. (A walk in index order lets a client whose cluster is used up take a
member of a cluster that has not paired yet.)

[choice] Remainder (spec: sizes may differ from V when V does not divide M). With
M = qV + r, 0 < r < V, there are q groups of exactly V and one group of the r clients
left over. No group is larger than V: the paper sets V "due to limited computation and
communication of each client". The remainder follows V's plan as far as its binary
pieces agree with V's (all doubling rounds, and assembly while its top bits match V's);
the pieces left over are put together at the end. With r = 1 that client is a group on
its own and trains alone. `random_groups` (the ablation) uses the same sizes.
"""

from __future__ import annotations

import numpy as np

_ROWS = 256  # rows per block where a step works through an M x M matrix in place

__all__ = [
    "merge_plan",
    "pair_up",
    "form_groups",
    "symmetric",
    "random_groups",
    "collaboration_matrix",
    "group_dissimilarity",
]


def _pieces(n: int) -> list[int]:
    """The powers of two in n's binary expansion, largest first (6 -> [4, 2])."""
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


def merge_plan(count: int, group_size: int) -> list[tuple[int, int, int]]:
    """Rounds of (size a, size b, merges), a >= b: each merges that many pairs of units of
    sizes a and b. Starting from `count` single clients, the rounds leave count // V units of
    size V and the count % V others in units smaller than V."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    full, rest = divmod(count, group_size)
    rounds = []
    for k in range(1, group_size.bit_length()):  # doubling: sum over groups of floor(n / 2^k)
        half = 1 << (k - 1)
        rounds.append((half, half, full * (group_size >> k) + (rest >> k)))
    pieces, rest_pieces = _pieces(group_size), _pieces(rest)
    for j in range(1, len(pieces)):  # assembly: partial of j pieces + the next piece
        shares = rest_pieces[: j + 1] == pieces[: j + 1]  # the remainder's same merge
        rounds.append((sum(pieces[:j]), pieces[j], full + int(shares)))
    return [step for step in rounds if step[2] > 0]


def _greedy_matching(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs taken in order of w (ties: lower indices first), skipping any whose unit is
    already taken, over finite entries of the symmetric w (overwritten): (i, j, weight),
    i < j, in that order. Computed as rounds of mutual best pairs among untaken units;
    only units whose best partner was taken look again, so it stays O(n^2) overall."""
    rows = np.arange(len(w))
    best = w.argmin(axis=1)  # argmin's lowest-index tie-break is the order above
    alive = np.isfinite(w[rows, best])
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    while True:
        cand = np.flatnonzero(alive)
        partner = best[cand]
        mutual = cand[(best[partner] == cand) & (cand < partner)]
        if not len(mutual):  # the smallest remaining pair is always mutual: none left
            break
        mates = best[mutual]
        found.append((mutual, mates, w[mutual, mates]))
        gone = np.concatenate([mutual, mates])
        alive[gone] = False
        w[:, gone] = np.inf
        stale = np.flatnonzero(alive & ~alive[best])
        for start in range(0, len(stale), _ROWS):  # in blocks of rows: no copy of w
            part = stale[start : start + _ROWS]
            best[part] = w[part].argmin(axis=1)
            alive[part] = np.isfinite(w[part, best[part]])
    if not found:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    i, j, weight = (np.concatenate(parts) for parts in zip(*found))
    order = np.lexsort((j, i, weight))
    return i[order], j[order], weight[order]


def _merge_round(
    d: np.ndarray, sizes: np.ndarray, a: int, b: int, merges: int, rng: np.random.Generator
) -> np.ndarray:
    """(merges, 2) unit pairs, one unit of size a and one of size b each: the most similar
    such pairs in greedy order, then random ones (the paper's random pairing)."""
    is_a, is_b = sizes == a, sizes == b
    cand = np.flatnonzero(is_a | is_b)
    among = d if len(cand) == len(d) else d[np.ix_(cand, cand)]
    if a == b:  # every candidate pair is of the type: one copy (the matching overwrites it)
        w = among.copy() if among is d else among
    else:
        ca, cb = is_a[cand], is_b[cand]
        w = np.where((ca[:, None] & cb[None, :]) | (cb[:, None] & ca[None, :]), among, np.inf)
    np.fill_diagonal(w, np.inf)
    i, j, _ = _greedy_matching(w)
    pairs = np.stack([cand[i[:merges]], cand[j[:merges]]], axis=1)
    short = merges - len(pairs)
    if short > 0:  # too few known pairs of this type: pair the rest at random
        free = np.ones(len(sizes), dtype=bool)
        free[pairs.ravel()] = False
        if a == b:
            extra = rng.permutation(np.flatnonzero(free & is_a))[: 2 * short].reshape(-1, 2)
        else:
            extra = np.stack(
                [
                    rng.permutation(np.flatnonzero(free & is_a))[:short],
                    rng.permutation(np.flatnonzero(free & is_b))[:short],
                ],
                axis=1,
            )
        if len(extra) != short:
            raise AssertionError(
                "merge plan does not match the units"
            )  # unreachable by construction
        pairs = np.concatenate([pairs, extra])
    return pairs


def _pool(d: np.ndarray, labels: np.ndarray, count: int) -> np.ndarray:
    """(count, count): the smallest entry of d between units labelled u and v (diagonal
    inf). Reduced in blocks of units, so no reordered copy of d is made."""
    order = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[order], np.arange(count))
    ends = np.append(starts[1:], len(order))
    rows = np.empty((count, d.shape[1]), dtype=d.dtype)
    step = max(1, _ROWS // max(int(np.diff(np.append(starts, len(order))).max()), 1))
    for first in range(0, count, step):  # units first .. first + step: their members' rows, reduced
        last = min(first + step, count)
        members = order[starts[first] : ends[last - 1]]
        rows[first:last] = np.minimum.reduceat(
            d[members], starts[first:last] - starts[first], axis=0
        )
    out = np.empty((count, count), dtype=d.dtype)
    for first in range(0, count, _ROWS):
        out[first : first + _ROWS] = np.minimum.reduceat(
            rows[first : first + _ROWS][:, order], starts, axis=1
        )
    np.fill_diagonal(out, np.inf)
    return out


def symmetric(dissimilarity: np.ndarray) -> np.ndarray:
    """A fresh copy, known where either end measured it; every unknown entry (negative, NaN
    or inf: unmeasured) is inf, and so is the diagonal. Float32 inputs stay float32 (grouping
    only compares and takes minima, exact in the input's precision). Symmetrised in blocks,
    in place: one M x M copy in all."""
    source = np.asarray(dissimilarity)
    d: np.ndarray = np.array(source, dtype=np.float32 if source.dtype == np.float32 else np.float64)
    block = 1024
    for top in range(0, len(d), block):
        for left in range(top, len(d), block):
            upper, lower = (
                d[top : top + block, left : left + block],
                d[left : left + block, top : top + block].T,
            )
            known = np.fmin(
                np.where(upper >= 0, upper, np.inf), np.where(lower >= 0, lower, np.inf)
            )
            d[top : top + block, left : left + block] = known
            d[left : left + block, top : top + block] = known.T
    np.fill_diagonal(d, np.inf)
    return d


def pair_up(dissimilarity: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
    """One pairing round on single units (the paper's step 2): most similar pairs first,
    then random pairs; with an odd count the last unit joins its most similar pair (a
    random one if it knows none of them)."""
    d = symmetric(dissimilarity)
    count = len(d)
    pairs = np.sort(_merge_round(d, np.ones(count, dtype=np.int64), 1, 1, count // 2, rng), axis=1)
    out = [[int(i), int(k)] for i, k in pairs]
    if count % 2 and out:
        last = int(np.setdiff1d(np.arange(count), pairs.ravel())[0])
        link = np.fmin(d[last, pairs[:, 0]], d[last, pairs[:, 1]])
        target = int(np.argmin(link)) if np.isfinite(link).any() else int(rng.integers(len(out)))
        out[target].append(last)
    elif count % 2:
        out.append([0])
    return out


def form_groups(
    dissimilarity: np.ndarray, group_size: int, rng: np.random.Generator
) -> list[list[int]]:
    """Groups of `group_size` clients from an (M, M) matrix of sampled L1 dissimilarities
    (np.inf where unknown): M // V groups of exactly V plus, when V does not divide M, one
    group of the M % V remaining clients. Sorted lists of client ids, sorted by first id."""
    d = symmetric(dissimilarity)
    count = len(d)
    unit_of = np.arange(count)  # the current unit of each client
    sizes = np.ones(count, dtype=np.int64)
    plan = merge_plan(count, group_size)
    for step, (a, b, merges) in enumerate(plan):
        pairs = _merge_round(d, sizes, a, b, merges, rng)
        label = np.arange(len(sizes))
        label[pairs.max(axis=1)] = pairs.min(axis=1)
        _, label = np.unique(label, return_inverse=True)  # units ordered by lowest old index
        sizes = np.bincount(label, weights=sizes).astype(np.int64)
        unit_of = label[unit_of]
        if step + 1 < len(plan):
            d = _pool(d, label, len(sizes))
    key = np.where(sizes[unit_of] == group_size, unit_of, -1)  # -1: the remainder group
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    return sorted(part.tolist() for part in np.split(order, cuts))


def random_groups(count: int, group_size: int, rng: np.random.Generator) -> list[list[int]]:
    """The ablation: clients shuffled into groups of `group_size`, the last holding the
    count % group_size left over (the same sizes as `form_groups`)."""
    order = [int(i) for i in rng.permutation(count)]
    return sorted(sorted(order[i : i + group_size]) for i in range(0, count, group_size))


def group_dissimilarity(dissimilarity: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """(G, G): the smallest known client dissimilarity between two groups (diagonal inf)."""
    members = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    labels = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    return _pool(
        np.asarray(dissimilarity, dtype=np.float64)[np.ix_(members, members)], labels, len(groups)
    )


def collaboration_matrix(groups: list[list[int]], count: int) -> np.ndarray:
    """Symmetric binary matrix G with G[i, j] = 1 iff i and j share a group (i != j)."""
    matrix = np.zeros((count, count), dtype=np.int8)
    for members in groups:
        matrix[np.ix_(members, members)] = 1
    np.fill_diagonal(matrix, 0)
    return matrix
