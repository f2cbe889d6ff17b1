"""Partitioners: iid, alpha ("similarity"), shards, dirichlet and natural (by writer),
plus the P4 paper's dataset presets."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from p4bench.config import RunConfig
from p4bench.data.base import Partitioner
from p4bench.errors import DataError
from p4bench.options import Option, resolve_options


class IIDPartitioner(Partitioner):
    """Each client gets R samples drawn uniformly at random, without overlap."""

    name = "iid"
    description = "uniform random split, same size for every client"

    def partition(
        self,
        labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        samples_per_client: int | None,
        rng: np.random.Generator,
        config: RunConfig,
    ) -> list[np.ndarray]:
        total = len(labels)
        size = samples_per_client if samples_per_client is not None else total // num_clients
        if size < 2 or size * num_clients > total:
            raise DataError(
                f"iid partitioner: {num_clients} clients x {size} samples needs {size * num_clients} samples, "
                f"the dataset has {total} (at most {total // num_clients} per client)"
            )
        order = rng.permutation(total)
        return [order[i * size : (i + 1) * size] for i in range(num_clients)]


class AlphaPartitioner(Partitioner):
    """P4 / Noble et al. "similarity": a fraction gamma of each client's samples have
    uniformly random labels, the rest come from the client's dominant class
    (client u's dominant class is u mod L). Samples are never reused; a class that
    runs out is an error, not a silent truncation.
    """

    name = "alpha"
    description = (
        "gamma% IID samples, the rest from one dominant class per client (--similarity gamma)"
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
        gamma = config.similarity
        pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        available = np.array([len(p) for p in pools])
        label_draws = rng.random((num_clients, len(labels) // num_clients + 1))

        def demand(size: int) -> np.ndarray:
            n_iid = int(gamma * size)
            iid_labels = np.minimum(
                (label_draws[:, :n_iid] * num_classes).astype(np.int64), num_classes - 1
            )
            counts = np.zeros((num_clients, num_classes), dtype=np.int64)
            np.add.at(counts, (np.repeat(np.arange(num_clients), n_iid), iid_labels.ravel()), 1)
            counts[np.arange(num_clients), np.arange(num_clients) % num_classes] += size - n_iid
            return counts

        def fits(size: int) -> bool:
            return bool((demand(size).sum(axis=0) <= available).all())

        largest = _largest_feasible(fits, upper=len(labels) // num_clients)
        size = samples_per_client if samples_per_client is not None else largest
        if size < 2 or not fits(size):
            raise DataError(
                f"alpha partitioner (similarity {gamma:g}): the dataset cannot give {num_clients} clients "
                f"{size} samples each without reusing samples; at most {largest} per client fit"
            )
        counts = demand(size)
        cursors = np.zeros(num_classes, dtype=np.int64)
        clients = []
        for u in range(num_clients):
            parts = []
            for c in np.flatnonzero(counts[u]):
                parts.append(pools[c][cursors[c] : cursors[c] + counts[u, c]])
                cursors[c] += counts[u, c]
            clients.append(rng.permutation(np.concatenate(parts)))
        return clients


def _largest_feasible(fits: Callable[[int], bool], upper: int) -> int:
    """Largest size in [0, upper] with fits(size), assuming feasibility is monotone."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


# Table I of the P4 paper: clients M and samples per client R (train + test).
PRESETS: dict[str, dict[str, int]] = {
    "femnist": {"clients": 200, "samples_per_client": 300, "num_classes": 47},
    "cifar10": {"clients": 260, "samples_per_client": 200, "num_classes": 10},
    "cifar100": {"clients": 60, "samples_per_client": 250, "num_classes": 100},
}


def _class_pools(
    labels: np.ndarray, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each class's sample indices in random order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


# --- shards -------------------------------------------------------------------------


class ShardsPartitioner(Partitioner):
    """Li et al. / P4 shards: each class is cut into P shards of equal size, and each of
    the M = L*P/N clients gets N distinct random classes with one shard of each.

    P is derived from the requested M (P = M*N/L, which must be an integer). With R
    samples per client every shard holds R/N samples; without R shards are as large as
    the smallest class allows.
    """

    name = "shards"
    description = (
        "N random classes per client, one shard of each (option shards_per_client N, default 2)"
    )
    # Partitioner options live in `config.options`, since RunConfig's fields are fixed.
    options = (
        Option(
            "shards_per_client",
            int,
            2,
            "N, distinct classes (one shard each) per client (--shards-per-client)",
            low=1,
        ),
        Option(
            "shards_per_class",
            int,
            None,
            "P, shards per class; default: derived as M * N / L (a given value must agree)",
            low=1,
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
        values = resolve_options(self.options, config.options)
        per_client = values["shards_per_client"]
        if per_client > num_classes:
            raise DataError(
                f"shards partitioner: {per_client} classes per client, but the dataset has {num_classes}"
            )
        total_shards = num_clients * per_client
        if total_shards % num_classes:
            valid = num_classes // np.gcd(num_classes, per_client)
            raise DataError(
                f"shards partitioner: M*N/L = {num_clients}*{per_client}/{num_classes} is not an integer, so the "
                f"classes cannot be cut into equal numbers of shards; "
                f"use a number of clients that is a multiple of {valid}"
            )
        per_class = total_shards // num_classes
        given = values["shards_per_class"]
        if given is not None and given != per_class:
            raise DataError(
                f"shards partitioner: shards_per_class={given!r} contradicts "
                f"M*N/L = {num_clients}*{per_client}/{num_classes} = {per_class}"
            )
        pools = _class_pools(labels, num_classes, rng)
        smallest = min(len(p) for p in pools)
        if samples_per_client is None:
            shard = smallest // per_class
        else:
            if samples_per_client % per_client:
                raise DataError(
                    f"shards partitioner: {samples_per_client} samples per client "
                    f"cannot be split into {per_client} equal shards"
                )
            shard = samples_per_client // per_client
        if shard < 1 or shard * per_class > smallest:
            raise DataError(
                f"shards partitioner: {per_class} shards of {max(shard, 1)} samples per class "
                f"need {per_class * max(shard, 1)} "
                f"samples of every class, the smallest class has {smallest} "
                f"(at most {smallest // per_class * per_client} samples per client)"
            )
        assignment = _assign_classes(num_clients, per_client, num_classes, per_class, rng)
        cursors = np.zeros(num_classes, dtype=np.int64)
        clients = []
        for classes in assignment:
            parts = []
            for c in classes:
                parts.append(pools[c][cursors[c] : cursors[c] + shard])
                cursors[c] += shard
            clients.append(rng.permutation(np.concatenate(parts)))
        return clients


def _assign_classes(
    clients: int, per_client: int, num_classes: int, per_class: int, rng: np.random.Generator
) -> np.ndarray:
    """(clients, per_client) class ids: distinct within a row, each class exactly per_class times.

    Starts from a valid layout (a random class order repeated, cut into rows of
    per_client consecutive entries, which are distinct because per_client <= L) and
    mixes it with random swaps that keep it valid, so the rows are random.
    """
    order = rng.permutation(num_classes)
    table = np.tile(order, per_class).reshape(clients, per_client)
    if clients < 2:
        return table
    members = [set(row.tolist()) for row in table]
    steps = 20 * clients * per_client
    rows, slots = (
        rng.integers(clients, size=(steps, 2)).tolist(),
        rng.integers(per_client, size=(steps, 2)).tolist(),
    )
    for (u, v), (i, j) in zip(rows, slots):
        a, b = int(table[u, i]), int(table[v, j])
        if u == v or a == b or b in members[u] or a in members[v]:
            continue
        table[u, i], table[v, j] = b, a
        members[u].remove(a), members[u].add(b)
        members[v].remove(b), members[v].add(a)
    return table


# --- dirichlet ----------------------------------------------------------------------


class DirichletPartitioner(Partitioner):
    """Label skew of Hsu et al.: client u's class proportions p_u ~ Dir(alpha * 1_L) and
    its R labels ~ Multinomial(R, p_u), filled from unused samples of each class.

    A draw that asks a class for more samples than remain is redrawn (up to
    `dirichlet_retries` times); a request that still does not fit is an error, never a
    truncation. Without R the size is the largest that fits, found by bisection.
    """

    name = "dirichlet"
    description = "per-client class proportions ~ Dir(alpha) (option dirichlet_alpha, default 0.5)"
    options = (
        Option(
            "dirichlet_alpha",
            float,
            0.5,
            "concentration alpha of the per-client class proportions",
            low=0,
            low_open=True,
        ),
        Option(
            "dirichlet_retries",
            int,
            100,
            "redraws per client before a size counts as infeasible",
            low=1,
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
        values = resolve_options(self.options, config.options)
        alpha, retries = values["dirichlet_alpha"], values["dirichlet_retries"]
        available = np.bincount(labels, minlength=num_classes)[:num_classes]
        # Every attempted size replays the same seeded stream, so the result depends only on the seed.
        state = rng.bit_generator.state

        def attempt(size: int) -> np.ndarray | None:
            rng.bit_generator.state = state
            return _dirichlet_counts(num_clients, size, alpha, available.copy(), retries, rng)

        size = samples_per_client
        if size is None:
            size = _largest_feasible(
                lambda s: s < 2 or attempt(s) is not None, upper=len(labels) // num_clients
            )
        counts = attempt(size) if size >= 2 else None
        if counts is None:
            raise DataError(
                f"dirichlet partitioner (alpha {alpha:g}): cannot give {num_clients} clients {size} samples each "
                f"without reusing samples (classes have {available.min()}..{available.max()} samples); "
                f"ask for fewer clients or samples, or a larger dirichlet_alpha"
            )
        pools = _class_pools(labels, num_classes, rng)
        cursors = np.zeros(num_classes, dtype=np.int64)
        clients = []
        for row in counts:
            parts = []
            for c in np.flatnonzero(row):
                parts.append(pools[c][cursors[c] : cursors[c] + row[c]])
                cursors[c] += row[c]
            clients.append(rng.permutation(np.concatenate(parts)))
        return clients


def _dirichlet_counts(
    clients: int,
    size: int,
    alpha: float,
    remaining: np.ndarray,
    retries: int,
    rng: np.random.Generator,
) -> np.ndarray | None:
    """(clients, L) per-class counts, or None when some client cannot be fitted."""
    counts = np.zeros((clients, len(remaining)), dtype=np.int64)
    for u in range(clients):
        for _ in range(retries):
            proportions = rng.dirichlet(np.full(len(remaining), alpha))
            row = rng.multinomial(size, proportions)
            if (row <= remaining).all():
                break
        else:
            return None
        counts[u] = row
        remaining -= row
    return counts


# --- natural ------------------------------------------------------------------------


class NaturalPartitioner(Partitioner):
    """One client per writer (LEAF) or generating client (synthetic): M writers are
    chosen at random from those with at least R samples; each client gets R of its
    writer's samples, or all of them when R is not given (sizes then differ).
    """

    name = "natural"
    description = "one client per writer / generated client (datasets with writer ids: leaf-femnist, synthetic)"
    needs_writers = True

    def partition(
        self,
        labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        samples_per_client: int | None,
        rng: np.random.Generator,
        config: RunConfig,
        writers: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        if writers is None:
            raise DataError(
                "natural partitioner needs writer ids; use a dataset that has them (leaf-femnist, synthetic)"
            )
        writers = np.asarray(writers)
        if len(writers) != len(labels):
            raise DataError(
                f"natural partitioner: {len(writers)} writer ids for {len(labels)} samples"
            )
        if samples_per_client is not None and samples_per_client < 2:
            raise DataError("natural partitioner: samples per client must be at least 2")
        ids, inverse, sizes = np.unique(writers, return_inverse=True, return_counts=True)
        need = samples_per_client if samples_per_client is not None else 2
        eligible = np.flatnonzero(sizes >= need)
        if len(eligible) < num_clients:
            raise DataError(
                f"natural partitioner: {num_clients} clients need {num_clients} writers with at least {need} samples "
                f"each; the dataset has {len(eligible)} such writers (of {len(ids)})"
            )
        chosen = rng.choice(eligible, size=num_clients, replace=False)
        order = np.argsort(inverse, kind="stable")
        starts = np.concatenate([[0], np.cumsum(sizes)])
        clients = []
        for w in chosen:
            own = rng.permutation(order[starts[w] : starts[w + 1]])
            clients.append(own if samples_per_client is None else own[:samples_per_client])
        return clients
