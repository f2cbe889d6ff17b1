"""Property tests for every partitioner: disjoint, exact sizes, target skew, seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p4bench.config import RunConfig
from p4bench.data.base import ArrayDataset, run_partitioner
from p4bench.data.partitioners import (
    PRESETS,
    AlphaPartitioner,
    DirichletPartitioner,
    IIDPartitioner,
    NaturalPartitioner,
    ShardsPartitioner,
)
from p4bench.errors import ConfigError, DataError

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def labels_for(counts: list[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)), counts))


def assert_disjoint(parts: list[np.ndarray], total: int) -> None:
    joined = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert len(np.unique(joined)) == len(joined), "a sample is in two clients"
    assert joined.min(initial=0) >= 0 and joined.max(initial=-1) < total


def run(partitioner, labels, num_classes, clients, size, seed, similarity=0.5, **options):
    config = RunConfig(similarity=similarity, options=options)
    return partitioner.partition(
        labels, num_classes, clients, size, np.random.default_rng(seed), config
    )


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


datasets = st.tuples(st.lists(st.integers(10, 60), min_size=2, max_size=8), st.integers(0, 2**16))


# --- iid ----------------------------------------------------------------------------


@SETTINGS
@given(datasets, st.integers(2, 12), st.integers(2, 30), st.integers(0, 1000))
def test_iid(data, clients, size, seed):
    counts, label_seed = data
    labels = labels_for(counts, label_seed)
    try:
        parts = run(IIDPartitioner(), labels, len(counts), clients, size, seed)
    except DataError:
        assert clients * size > len(labels)
        return
    assert [len(p) for p in parts] == [size] * clients
    assert_disjoint(parts, len(labels))
    assert same(parts, run(IIDPartitioner(), labels, len(counts), clients, size, seed))


# --- alpha --------------------------------------------------------------------------


@SETTINGS
@given(
    st.integers(2, 6),
    st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
    st.integers(4, 12),
    st.integers(0, 1000),
)
def test_alpha_dominant_fraction(num_classes, gamma, clients, seed):
    labels = labels_for([400] * num_classes, seed)
    size = 60
    parts = run(AlphaPartitioner(), labels, num_classes, clients, size, seed, similarity=gamma)
    assert [len(p) for p in parts] == [size] * clients
    assert_disjoint(parts, len(labels))
    dominant = np.array([np.mean(labels[p] == u % num_classes) for u, p in enumerate(parts)])
    n_iid = int(gamma * size)
    target = (size - n_iid) / size + n_iid / (num_classes * size)
    spread = (
        math.sqrt(n_iid * (1 / num_classes) * (1 - 1 / num_classes)) / size / math.sqrt(clients)
    )
    assert abs(dominant.mean() - target) <= 5 * spread + 1e-9
    assert (dominant >= (size - n_iid) / size).all()  # the non-IID part is all dominant class
    assert same(
        parts, run(AlphaPartitioner(), labels, num_classes, clients, size, seed, similarity=gamma)
    )


def test_alpha_refuses_to_truncate():
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(DataError, match="at most"):
        run(AlphaPartitioner(), labels, 2, 4, 40, 0, similarity=0.0)  # needs 80 samples of class 0


# --- shards -------------------------------------------------------------------------


@SETTINGS
@given(st.integers(2, 10), st.data(), st.integers(0, 1000))
def test_shards_exact_classes(num_classes, data, seed):
    per_client = data.draw(st.integers(1, num_classes), label="N")
    t = data.draw(st.integers(1, 4), label="t")
    clients = num_classes * t // math.gcd(num_classes, per_client)
    per_class = clients * per_client // num_classes
    shard = data.draw(st.integers(1, 6), label="shard size")
    counts = [per_class * shard + data.draw(st.integers(0, 5)) for _ in range(num_classes)]
    labels = labels_for(counts, seed)
    parts = run(
        ShardsPartitioner(),
        labels,
        num_classes,
        clients,
        per_client * shard,
        seed,
        shards_per_client=per_client,
    )
    assert len(parts) == clients
    assert [len(p) for p in parts] == [per_client * shard] * clients
    assert_disjoint(parts, len(labels))
    uses = np.zeros(num_classes, np.int64)
    for p in parts:
        present, count = np.unique(labels[p], return_counts=True)
        assert (
            len(present) == per_client and (count == shard).all()
        )  # exactly N classes, one shard each
        uses[present] += 1
    assert (uses == per_class).all()  # every class cut into exactly P shards
    again = run(
        ShardsPartitioner(),
        labels,
        num_classes,
        clients,
        per_client * shard,
        seed,
        shards_per_client=per_client,
    )
    assert same(parts, again)


def test_shards_errors_are_clear():
    labels = np.repeat(np.arange(10), 30)
    with pytest.raises(DataError, match="not an integer"):
        run(ShardsPartitioner(), labels, 10, 7, 20, 0, shards_per_client=2)
    with pytest.raises(DataError, match="smallest class"):
        run(
            ShardsPartitioner(), labels, 10, 10, 40, 0, shards_per_client=2
        )  # P=2 shards of 20 > 30
    with pytest.raises(DataError, match="equal shards"):
        run(ShardsPartitioner(), labels, 10, 10, 21, 0, shards_per_client=2)
    with pytest.raises(DataError, match="contradicts"):
        run(ShardsPartitioner(), labels, 10, 10, 20, 0, shards_per_client=2, shards_per_class=3)
    # P4's FEMNIST grid: 200 clients x 2 shards over 47 classes cannot be integral.
    with pytest.raises(DataError, match="multiple of 47"):
        run(ShardsPartitioner(), np.repeat(np.arange(47), 40), 47, 200, 20, 0, shards_per_client=2)


def test_shards_without_size_uses_the_smallest_class():
    labels = labels_for([30, 25, 40, 33], 0)
    parts = run(ShardsPartitioner(), labels, 4, 4, None, 1, shards_per_client=2)  # P = 2
    assert {len(p) for p in parts} == {2 * 12}


# --- dirichlet ----------------------------------------------------------------------


@SETTINGS
@given(datasets, st.integers(2, 10), st.integers(2, 25), st.floats(0.05, 50), st.integers(0, 1000))
def test_dirichlet(data, clients, size, alpha, seed):
    counts, label_seed = data
    labels = labels_for(counts, label_seed)
    try:
        parts = run(
            DirichletPartitioner(), labels, len(counts), clients, size, seed, dirichlet_alpha=alpha
        )
    except DataError as exc:
        assert "cannot give" in str(exc)
        return
    assert [len(p) for p in parts] == [size] * clients
    assert_disjoint(parts, len(labels))
    assert same(
        parts,
        run(
            DirichletPartitioner(), labels, len(counts), clients, size, seed, dirichlet_alpha=alpha
        ),
    )


def test_dirichlet_alpha_controls_skew():
    labels = labels_for([2000] * 10, 0)
    skewed = run(DirichletPartitioner(), labels, 10, 30, 100, 0, dirichlet_alpha=0.05)
    flat = run(DirichletPartitioner(), labels, 10, 30, 100, 0, dirichlet_alpha=1000.0)

    def top(parts):
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    assert top(skewed) > 0.6
    assert top(flat) < 0.25  # near the uniform 0.1 (plus multinomial noise)
    # Class fractions of a flat client are within tolerance of 1/L.
    fractions = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in flat])
    assert np.abs(fractions.mean(axis=0) - 0.1).max() < 0.03


def test_dirichlet_errors_instead_of_truncating():
    labels = np.repeat(np.arange(3), 20)
    with pytest.raises(DataError, match="cannot give 5 clients 20 samples"):
        run(DirichletPartitioner(), labels, 3, 5, 20, 0)
    parts = run(DirichletPartitioner(), labels, 3, 3, None, 0)  # as large as fits, equal sizes
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) >= 2
    assert_disjoint(parts, len(labels))
    with pytest.raises(ConfigError, match="dirichlet_alpha"):
        run(DirichletPartitioner(), labels, 3, 3, 5, 0, dirichlet_alpha=0)
    with pytest.raises(ConfigError, match="shards_per_client"):
        run(ShardsPartitioner(), labels, 3, 3, 4, 0, shards_per_client="two")


# --- natural ------------------------------------------------------------------------


@SETTINGS
@given(
    st.lists(st.integers(1, 30), min_size=2, max_size=15),
    st.integers(1, 8),
    st.integers(2, 12),
    st.integers(0, 1000),
)
def test_natural_one_client_per_writer(writer_sizes, clients, size, seed):
    writers = np.random.default_rng(seed).permutation(
        np.repeat(np.arange(len(writer_sizes)) * 7 + 3, writer_sizes)
    )
    labels = np.random.default_rng(seed + 1).integers(0, 4, len(writers))
    partitioner = NaturalPartitioner()
    config = RunConfig()
    try:
        parts = partitioner.partition(
            labels, 4, clients, size, np.random.default_rng(seed), config, writers=writers
        )
    except DataError:
        assert sum(s >= size for s in writer_sizes) < clients
        return
    assert [len(p) for p in parts] == [size] * clients
    assert_disjoint(parts, len(labels))
    owners = [np.unique(writers[p]) for p in parts]
    assert all(len(o) == 1 for o in owners)  # each client is one writer
    assert len({int(o[0]) for o in owners}) == clients  # and no writer is used twice
    again = partitioner.partition(
        labels, 4, clients, size, np.random.default_rng(seed), config, writers=writers
    )
    assert same(parts, again)


def test_natural_needs_writers_and_keeps_whole_writers():
    labels = np.zeros(10, np.int64)
    with pytest.raises(DataError, match="writer ids"):
        NaturalPartitioner().partition(labels, 1, 2, None, np.random.default_rng(0), RunConfig())
    writers = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    parts = NaturalPartitioner().partition(
        labels, 1, 3, None, np.random.default_rng(0), RunConfig(), writers=writers
    )
    assert sorted(len(p) for p in parts) == [2, 3, 5]


def test_run_partitioner_passes_writers_only_when_needed():
    x = np.zeros((12, 2), np.float32)
    y = np.arange(12) % 2
    w = np.repeat(np.arange(4), 3)
    data = ArrayDataset(
        "d", x[:8], y[:8], x[8:], y[8:], ("a", "b"), writers_train=w[:8], writers_test=w[8:]
    )
    parts = run_partitioner(NaturalPartitioner, data, 4, 3, np.random.default_rng(0), RunConfig())
    assert sorted(int(np.unique(w[p])[0]) for p in parts) == [0, 1, 2, 3]
    assert (
        len(run_partitioner(IIDPartitioner, data, 3, 4, np.random.default_rng(0), RunConfig())) == 3
    )


def test_presets_match_the_paper():
    assert PRESETS["femnist"]["clients"] == 200 and PRESETS["femnist"]["samples_per_client"] == 300
    assert PRESETS["cifar10"]["clients"] == 260 and PRESETS["cifar10"]["samples_per_client"] == 200
    assert PRESETS["cifar100"]["clients"] == 60 and PRESETS["cifar100"]["samples_per_client"] == 250
    # CIFAR-10's preset fits every heterogeneity setting of the paper without reusing samples.
    labels = labels_for([6000] * 10, 0)
    for gamma in (0.25, 0.5, 0.75):
        parts = run(AlphaPartitioner(), labels, 10, 260, 200, 0, similarity=gamma)
        assert_disjoint(parts, len(labels))
    for n in (2, 4, 8):
        parts = run(ShardsPartitioner(), labels, 10, 260, 200, 0, shards_per_client=n)
        assert {len(np.unique(labels[p])) for p in parts} == {n}


def test_partition_heatmap_has_whole_client_ticks(tmp_path, monkeypatch):
    import numpy as np
    from matplotlib.figure import Figure

    from p4bench.data.summary import plot_partition_heatmap

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: saved.append(self))
    plot_partition_heatmap(
        np.arange(40).reshape(4, 10), tuple(map(str, range(10))), tmp_path / "p.png"
    )
    ticks = [t for t in saved[0].axes[0].get_yticks() if -0.5 <= t <= 3.5]
    assert ticks and all(float(t).is_integer() for t in ticks)
