"""P4 group formation: exact target sizes for any V, the remainder group, recovery of
planted clusters, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from p4bench_p4.grouping import form_groups, group_dissimilarity, merge_plan, random_groups

SIZES = [2, 3, 4, 5, 6, 7, 8]
COUNTS = [20, 37, 100]


def _expected_sizes(count: int, size: int) -> list[int]:
    """The documented sizes: count // V groups of V, plus one group of count % V if nonzero."""
    full, rest = divmod(count, size)
    return sorted([size] * full + ([rest] if rest else []))


def _check_partition(groups: list[list[int]], count: int, size: int) -> None:
    members = [c for g in groups for c in g]
    assert sorted(members) == list(range(count))  # everyone, exactly once
    assert sorted(len(g) for g in groups) == _expected_sizes(count, size)
    assert all(g == sorted(g) for g in groups) and groups == sorted(groups)


def _sampled_matrix(count: int, seed: int, known: float) -> np.ndarray:
    """L1 dissimilarities of random points, each pair measured with probability `known`."""
    rng = np.random.default_rng(seed)
    points = rng.normal(size=(count, 5))
    d = np.abs(points[:, None] - points[None]).sum(-1)
    mask = rng.random(d.shape) < known
    return np.where(mask | mask.T, d, np.inf)


def _planted(
    count: int, size: int, seed: int, known_between: float = 1.0
) -> tuple[np.ndarray, list[list[int]]]:
    """Shuffled clusters of `size` (and one of count % size) with within-cluster distances
    in [0, 1) and between-cluster ones in [10, 20); a share of the between pairs unknown."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(count)
    clusters = [sorted(order[i : i + size].tolist()) for i in range(0, count, size)]
    label = np.empty(count, dtype=np.int64)
    for k, members in enumerate(clusters):
        label[members] = k
    same = label[:, None] == label[None, :]
    d = np.where(same, rng.random((count, count)), rng.uniform(10, 20, (count, count)))
    d = np.triu(d, 1) + np.triu(d, 1).T
    hidden = ~same & (rng.random((count, count)) >= known_between)
    d[hidden | hidden.T] = np.inf
    np.fill_diagonal(d, np.inf)
    return d, sorted(clusters)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_every_client_once_and_sizes_are_v_plus_one_remainder(size, count):
    for seed, known in [(0, 1.0), (1, 0.3), (2, 0.05), (3, 0.0)]:  # 0.0: nothing known, all random
        groups = form_groups(_sampled_matrix(count, seed, known), size, np.random.default_rng(seed))
        _check_partition(groups, count, size)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_planted_clusters_are_recovered(size, count):
    for seed in range(3):
        d, clusters = _planted(count, size, seed)
        assert form_groups(d, size, np.random.default_rng(seed)) == clusters


@pytest.mark.parametrize("size", [3, 6, 7])
def test_planted_clusters_are_recovered_with_unknown_pairs(size):
    d, clusters = _planted(100, size, seed=5, known_between=0.2)
    assert form_groups(d, size, np.random.default_rng(0)) == clusters


def test_remainder_is_planned_for_every_v_and_r():
    """For every V and remainder r, the plan's merges add up to q units of V plus r's
    clients in smaller units, and the planted remainder cluster comes out whole."""
    for size in range(1, 17):
        for rest in range(size):
            count = 3 * size + rest
            units = [1] * count
            for a, b, merges in merge_plan(count, size):
                for _ in range(merges):  # any realisation of the quotas gives the same sizes
                    units.remove(a)
                    units.remove(b)
                    units.append(a + b)
            assert sorted(u for u in units if u == size) == [size] * 3
            assert sum(u for u in units if u != size) == rest and max(units) == size
            d, clusters = _planted(count, size, seed=size * 17 + rest)
            assert form_groups(d, size, np.random.default_rng(rest)) == clusters, (size, rest)


def test_edge_sizes():
    d = _sampled_matrix(10, 0, 0.5)
    assert form_groups(d, 1, np.random.default_rng(0)) == [[i] for i in range(10)]
    assert form_groups(d, 10, np.random.default_rng(0)) == [list(range(10))]
    assert form_groups(d, 16, np.random.default_rng(0)) == [list(range(10))]  # V > M: one group
    with pytest.raises(ValueError):
        form_groups(d, 0, np.random.default_rng(0))


def test_deterministic_given_the_rng_and_symmetric_input_only():
    d = _sampled_matrix(100, 4, 0.1)
    first = form_groups(d, 6, np.random.default_rng(7))
    assert form_groups(d, 6, np.random.default_rng(7)) == first
    upper = np.where(np.triu(np.ones_like(d, dtype=bool), 1), d, np.inf)  # one end measured it
    assert form_groups(upper, 6, np.random.default_rng(7)) == first


def test_pairs_are_taken_most_similar_first_not_in_client_order():
    """After the mutual best pair (3, 4), 1 and 2 (3.0) pair before 0 takes 1 (5.0), as an
    index-order walk would; the odd ones (0, 5) pair last."""
    d = np.full((6, 6), 9.0)
    np.fill_diagonal(d, np.inf)
    for i, j, w in [(3, 4, 1.0), (2, 3, 2.0), (1, 2, 3.0), (0, 1, 5.0)]:
        d[i, j] = d[j, i] = w
    assert form_groups(d, 2, np.random.default_rng(0)) == [[0, 5], [1, 2], [3, 4]]


def test_group_dissimilarity_is_the_smallest_across_members():
    d = _sampled_matrix(12, 3, 0.6)
    groups = [[0, 5, 7], [1, 2], [3, 4, 6, 8], [9, 10, 11]]
    got = group_dissimilarity(d, groups)
    for a, ga in enumerate(groups):
        for b, gb in enumerate(groups):
            want = np.inf if a == b else d[np.ix_(ga, gb)].min()
            assert got[a, b] == want


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_random_groups_have_the_same_sizes(size, count):
    _check_partition(random_groups(count, size, np.random.default_rng(size)), count, size)


def test_the_old_name_of_the_unknown_distance_still_works_and_warns():
    import pytest

    import p4bench_p4.method as p4_method

    with pytest.warns(DeprecationWarning, match="UNKNOWN_SENT is deprecated"):
        assert p4_method.UNKNOWN_SENT == p4_method.UNKNOWN == -1.0
    with pytest.raises(AttributeError):
        p4_method.NO_SUCH_NAME  # noqa: B018
