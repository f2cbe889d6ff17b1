import torch

from p4bench.rng import ClientRng, node_keys, philox4x32


def _words(*values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


def test_philox_matches_random123_known_answers():
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        got = philox4x32(_words(*counter), _words(*key))
        assert tuple(int(w) for w in got) == expected


def test_a_clients_stream_does_not_depend_on_who_is_batched_with_it():
    keys = node_keys(3, list(range(6)))
    together = ClientRng(keys)
    together.bits(5)
    all_rows = together.uniform(7)
    alone = ClientRng(keys[4:5])
    alone.bits(5)
    assert torch.equal(alone.uniform(7)[0], all_rows[4])


def test_streams_differ_between_clients_seeds_and_purposes():
    a = ClientRng(node_keys(0, [0, 1])).bits(8)
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(ClientRng(node_keys(1, [0])).bits(8)[0], a[0])
    assert not torch.equal(ClientRng(node_keys(0, [0], purpose=2)).bits(8)[0], a[0])


def test_uniform_and_normal_moments():
    rng = ClientRng(node_keys(0, list(range(4))))
    u = rng.uniform(20000)
    assert ((u > 0) & (u < 1)).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    z = rng.normal(20000)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02


def test_subsets_are_distinct_valid_and_width_independent():
    keys = node_keys(5, [0, 1, 2])
    population = torch.tensor([10, 4, 7])
    size = torch.tensor([3, 4, 2])
    index, mask = ClientRng(keys).subsets(population, size, width=4)
    for row in range(3):
        chosen = index[row][mask[row]]
        assert len(chosen) == size[row]
        assert len(set(chosen.tolist())) == len(chosen)
        assert (chosen < population[row]).all()
    alone, alone_mask = ClientRng(keys[1:2]).subsets(population[1:2], size[1:2], width=4)
    assert torch.equal(alone[0][alone_mask[0]], index[1][mask[1]])


def _philox_in_python_integers(counter: list[int], key: list[int]) -> list[int]:
    """Philox4x32-10 as Random123 defines it, in Python's unbounded integers."""
    mask, multipliers, weyl = 0xFFFFFFFF, (0xD2511F53, 0xCD9E8D57), (0x9E3779B9, 0xBB67AE85)
    c, (k0, k1) = list(counter), key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + weyl[0]) & mask, (k1 + weyl[1]) & mask
        p0, p1 = multipliers[0] * c[0], multipliers[1] * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
    return c


def test_batched_philox_equals_the_definition_on_random_and_extreme_words():
    """The tensor version multiplies in wrapping int64 (the 64-bit products exceed int64's
    range): every word of every row must still be the definition's."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 2**32, (16, 2), generator=generator, dtype=torch.int64)
    keys[0], keys[1] = 0xFFFFFFFF, 0
    counter = [
        torch.randint(0, 2**32, (16, 9), generator=generator, dtype=torch.int64) for _ in range(4)
    ]
    for word in counter:
        word[:, 0], word[:, 1] = 0xFFFFFFFF, 0
    got = philox4x32(tuple(counter), (keys[:, :1], keys[:, 1:]))
    for row in range(16):
        for column in range(9):
            expected = _philox_in_python_integers(
                [int(w[row, column]) for w in counter], keys[row].tolist()
            )
            assert [int(w[row, column]) for w in got] == expected, (row, column)
