"""Client-Balancing Dirichlet Sampling (CBDS, Karras et al., Algorithm 1).

Every client's label distribution is a row of P ~ Dir(alpha * 1_l) (C x l). Swapping two
entries of a row keeps it a Dir(alpha) sample, so CBDS greedily swaps, one best swap per
iteration over all clients and unordered label pairs, while the swap strictly lowers
the column imbalance u(P) = sum_j |C/l - sum_i P[i, j]|. P is then divided by its
largest column sum: the most-used label's pool is used once, every column sums to <= 1
(the share of that label's pool handed out) and every client gets the same size.

The argmin prefers low (client, label) indices among ties; the loop runs on a random
global permutation of the labels, undone afterwards, so that preference is
label-symmetric (the spec's condition for each row's marginal to stay Dir(alpha)).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from p4bench.data.base import Partitioner, PartitionReport
from p4bench.errors import DataError
from p4bench.options import Option, resolve_options

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = ["CBDSMatrix", "CBDSPartitioner", "cbds_counts", "cbds_matrix", "imbalance"]


def imbalance(matrix: np.ndarray) -> float:
    """u(P) = sum_j |C/l - sum_i P[i, j]| (Eq. 2): 0 when every label is used equally."""
    clients, labels = matrix.shape
    return float(np.abs(clients / labels - matrix.sum(axis=0)).sum())


@dataclass(frozen=True)
class CBDSMatrix:
    """The outcome of Algorithm 1: `swapped` (rows sum to 1), `normalised` = swapped /
    max column sum, u before and after the swaps, and the u after every swap (`history`,
    recomputed from scratch, only when asked for)."""

    swapped: np.ndarray
    normalised: np.ndarray
    u_before: float
    u_after: float
    swaps: int
    history: tuple[float, ...] = ()

    @property
    def column_sums(self) -> np.ndarray:
        """pi_j = sum_i P[i, j] before normalisation."""
        sums: np.ndarray = self.swapped.sum(axis=0)
        return sums

    @property
    def undersampling(self) -> float:
        """Share of the label pools left unused: 1 - (C/l) / max(pi)."""
        clients, labels = self.swapped.shape
        return float(1.0 - (clients / labels) / self.column_sums.max())

    @property
    def label_undersampling(self) -> np.ndarray:
        """Per label: 1 - pi_j / max(pi), the share of its pool left unused."""
        sums = self.column_sums
        per_label: np.ndarray = 1.0 - sums / sums.max()
        return per_label


def cbds_matrix(
    clients: int, labels: int, alpha: float, rng: np.random.Generator, *, trace: bool = False
) -> CBDSMatrix:
    """Algorithm 1 for `clients` x `labels`; `trace` records u after every swap.

    A swap of P[i, j1] and P[i, j2] changes only the column sums s_j1 and s_j2, by
    +-(P[i, j2] - P[i, j1]), so each candidate's change of u is O(1): all C * l(l-1)/2
    of them are one array expression. After a swap only the candidates of pairs that
    involve j1 or j2 change (2 l - 3 pairs, every client); they are recomputed, together
    with the best client of each pair, so an iteration costs O(C l + l^2), not O(C l^2).
    """
    drawn = rng.dirichlet(np.full(labels, float(alpha)), size=clients)
    order = rng.permutation(labels)  # label-symmetric tie-breaking
    matrix = np.ascontiguousarray(drawn[:, order])
    target = clients / labels
    first, second = np.triu_indices(labels, k=1)  # unordered pairs j1 < j2: a swap is symmetric
    pairs = len(first)
    touching = [np.flatnonzero((first == j) | (second == j)) for j in range(labels)]
    sums = matrix.sum(axis=0)

    def change(cols: np.ndarray) -> np.ndarray:
        """(C, len(cols)) change of u if client i swapped the labels of pair cols[k]."""
        gap_first, gap_second = target - sums[first[cols]], target - sums[second[cols]]
        moved = matrix[:, second[cols]] - matrix[:, first[cols]]  # s_j1 += moved, s_j2 -= moved
        changed: np.ndarray = (
            np.abs(gap_first - moved)
            + np.abs(gap_second + moved)
            - (np.abs(gap_first) + np.abs(gap_second))
        )
        return changed

    delta = change(np.arange(pairs))
    best_row = delta.argmin(axis=0)
    best = delta[best_row, np.arange(pairs)]
    tolerance = 1e-12 * max(
        target, 1.0
    )  # strictly below float noise: u falls at every swap, the loop ends
    u_before = imbalance(matrix)
    history: list[float] = []
    swaps = 0
    while best.min() < -tolerance:
        ties = np.flatnonzero(best == best.min())
        pair = int(
            ties[np.argmin(best_row[ties] * pairs + ties)]
        )  # the first (client, pair), as argmin of all
        row, j1, j2 = int(best_row[pair]), int(first[pair]), int(second[pair])
        matrix[row, j1], matrix[row, j2] = matrix[row, j2], matrix[row, j1]
        sums[[j1, j2]] = matrix[:, [j1, j2]].sum(axis=0)
        stale = np.union1d(touching[j1], touching[j2])
        delta[:, stale] = change(stale)
        best_row[stale] = delta[:, stale].argmin(axis=0)
        best[stale] = delta[best_row[stale], stale]
        swaps += 1
        if trace:
            history.append(imbalance(matrix))
    restored = np.empty_like(matrix)
    restored[:, order] = matrix
    column_sums = restored.sum(axis=0)
    return CBDSMatrix(
        restored, restored / column_sums.max(), u_before, imbalance(restored), swaps, tuple(history)
    )


def cbds_counts(shares: np.ndarray, pool: int, size: int | None = None) -> np.ndarray:
    """(C, l) samples of each label per client from `shares` (the normalised P), every
    row summing to `size` (default: the largest equal size, floor(pool / max pi)) and no
    column exceeding `pool`, the samples per label.

    Client i's quota of label j is its row of P scaled to `size` samples. It gets the
    floor of every quota, plus one sample of the labels with the largest remainders
    until its row reaches `size`, while that label's pool lasts (largest remainders
    first among the clients asking for the same label). A column's remainders never
    exceed what its floors leave of the pool, so a client rarely finds every label it
    needs used up; if one does, all clients are trimmed to the smallest row, one sample
    at a time from the label furthest above its quota (a requested `size` that cannot be
    reached, or one above the largest, raises DataError). Plain floors would lose up to l
    samples per client (12% of CIFAR-10 at C = 1000).
    """
    row_total = shares.sum(axis=1) * pool  # each client's unrounded size, pool / max(pi)
    largest = int(np.floor(row_total.min() + 1e-9))
    if size is not None and size > largest:
        raise DataError(
            f"cbds partitioner: at most {largest} samples per client fit, {size} were asked for"
        )
    asked, size = size is not None, largest if size is None else size
    quotas = shares * (pool * size / row_total)[:, None]
    counts: np.ndarray = np.floor(quotas).astype(
        np.int64
    )  # a column's floors sum to at most its quotas' sum <= pool
    counts += _round_up(quotas - counts, size - counts.sum(axis=1), pool - counts.sum(axis=0))
    reached = int(counts.sum(axis=1).min())
    if reached < size and asked:
        raise DataError(
            f"cbds partitioner: the label pools cannot give every client {size} samples; at most {reached}"
        )
    size = reached
    _trim(counts, quotas * (size / quotas.sum(axis=1, keepdims=True)), counts.sum(axis=1) - size)
    return counts


def _round_up(remainders: np.ndarray, need: np.ndarray, room: np.ndarray) -> np.ndarray:
    """0/1 (C, l): `need[i]` labels per row, largest remainders first, at most `room[j]` per
    column. In rounds (at most 2 l: in each, a needy row is served or a label runs out),
    vectorised over clients; a row may end short where every label it could take is gone."""
    extra = np.zeros(remainders.shape, dtype=np.int64)
    need, room = need.copy(), room.copy()
    for _ in range(2 * remainders.shape[1]):
        score = np.where(
            (extra == 0) & (remainders > 0) & (need > 0)[:, None] & (room > 0)[None, :],
            remainders,
            -1.0,
        )
        label = score.argmax(axis=1)
        asking = np.flatnonzero(score[np.arange(len(score)), label] > 0)
        if len(asking) == 0:
            break
        asking = asking[
            np.lexsort((-score[asking, label[asking]], label[asking]))
        ]  # by label, largest first
        wanted = label[asking]
        rank = np.arange(len(asking)) - np.searchsorted(
            wanted, wanted
        )  # position among the label's askers
        granted = asking[rank < room[wanted]]
        extra[granted, label[granted]] = 1
        need[granted] -= 1
        room -= np.bincount(label[granted], minlength=len(room))
    return extra


def _trim(counts: np.ndarray, targets: np.ndarray, excess: np.ndarray) -> None:
    """Remove `excess[i]` samples from row i in place, each from the label furthest above its target."""
    rows = np.arange(len(counts))
    while excess.max(initial=0) > 0:  # fewer than l rounds: vectorised over clients
        over = np.where(excess[:, None] > 0, counts - targets, -np.inf)
        label = np.argmax(over, axis=1)  # sum(counts - targets) = excess > 0, so that count is >= 1
        trimmed = excess > 0
        counts[rows[trimmed], label[trimmed]] -= 1
        excess = excess - trimmed


class CBDSPartitioner(Partitioner):
    """CBDS: Dir(alpha) label distributions per client, balanced by greedy row swaps
    (Karras et al., Algorithm 1); disjoint clients of exactly equal size.

    The pool of every label is the smallest class's size n (the paper assumes |D|/l
    samples per label; larger classes keep their surplus unused). Client i gets about
    P[i, j] * n samples of label j, rounded to equal sizes within each pool (floor plus
    largest remainders, see `cbds_counts`); each label's indices are shuffled and handed
    out in consecutive blocks. Reports u(P) before and after, the undersampling (total
    and worst label) and P itself.
    """

    name = "cbds"
    description = "client-balancing Dirichlet sampling (Karras et al.): Dir(alpha) rows balanced by swaps, equal sizes"
    options = (
        Option(
            "cbds_alpha",
            float,
            1.0,
            "concentration alpha of each client's label distribution Dir(alpha)",
            low=0,
            low_open=True,
        ),
    )

    def partition(
        self,
        labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        samples_per_client: int | None,
        rng: np.random.Generator,
        config: RunConfig,
    ) -> list[np.ndarray]:
        alpha = resolve_options(self.options, config.options)["cbds_alpha"]
        labels = np.asarray(labels)
        available = np.bincount(labels, minlength=num_classes)[:num_classes]
        pool = int(available.min())
        if pool == 0:
            raise DataError(
                f"cbds partitioner: labels {np.flatnonzero(available == 0).tolist()} have no samples"
            )
        result = cbds_matrix(num_clients, num_classes, alpha, rng)
        counts = cbds_counts(result.normalised, pool, samples_per_client)
        size = int(counts[0].sum())
        if size < 2:
            raise DataError(
                f"cbds partitioner (alpha {alpha:g}): {num_clients} clients get {size} samples each from label pools "
                f"of {pool}; ask for fewer clients or a larger cbds_alpha"
            )
        owners, indices = [], []
        for label in range(num_classes):  # a loop over labels; clients are handled as arrays
            shuffled = rng.permutation(np.flatnonzero(labels == label))
            owners.append(np.repeat(np.arange(num_clients), counts[:, label]))
            indices.append(shuffled[: counts[:, label].sum()])
        owner, index = np.concatenate(owners), np.concatenate(indices)
        by_client = index[np.argsort(owner, kind="stable")].reshape(num_clients, size)
        by_client = rng.permuted(by_client, axis=1)
        self.report = _report(result, counts, pool, len(labels), alpha)
        return list(by_client)


def _report(
    result: CBDSMatrix, counts: np.ndarray, pool: int, total: int, alpha: float
) -> PartitionReport:
    clients = len(counts)
    stats = {
        "alpha": float(alpha),
        "u_before": result.u_before,
        "u_after": result.u_after,
        "swaps": float(result.swaps),
        "undersampling": result.undersampling,
        "undersampling_worst_label": float(result.label_undersampling.max()),
        "label_pool": float(pool),
        "samples_per_client": float(counts[0].sum()),
        "used_fraction": float(counts.sum() / total),  # of the whole pooled dataset
    }
    text = io.StringIO()
    table = np.column_stack([np.arange(clients), result.normalised])
    header = ",".join(["client", *[f"label_{j}" for j in range(counts.shape[1])]])
    np.savetxt(
        text,
        table,
        fmt=["%d"] + ["%.10g"] * counts.shape[1],
        delimiter=",",
        header=header,
        comments="",
    )
    return PartitionReport(stats=stats, artifacts={"partition_matrix.csv": text.getvalue()})
