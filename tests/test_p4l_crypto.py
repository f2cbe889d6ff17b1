"""P4L crypto: fixed point and packing, packed Paillier chains, serialization, decryption proofs, signatures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p4bench_p4l.crypto import (
    BACKENDS,
    SCALE,
    VALUE_BOUND,
    PaillierBackend,
    PlaintextBackend,
    decode,
    encode,
    from_bytes_tensor,
    max_slots,
    pack,
    to_bytes_tensor,
    unpack,
)
from p4bench_p4l.signing import SigningKeys, canonical_bytes, verify


@pytest.fixture(scope="module")
def keys512():
    return PaillierBackend().generate(512)


@pytest.fixture(scope="module")
def keys1024():
    return PaillierBackend().generate(1024)


def _signed(plaintexts: list[int], n: int) -> list[int]:
    return [m - n if m > n // 2 else m for m in plaintexts]


def test_fixed_point_and_packing_round_trip_with_negatives_and_extremes():
    top = (VALUE_BOUND - 1024) / SCALE  # the largest float below the bound (spacing 128 there)
    values = np.array(
        [0.0, -0.0, 1.5, -1.5, 1e-10, -1e-10, 4e-11, top, -top, 123.456789012], dtype=np.float64
    )
    fixed = encode(values)
    assert fixed.tolist() == [round(v * SCALE) for v in values.tolist()]
    np.testing.assert_allclose(decode(fixed), values, atol=1e-10, rtol=0)
    assert encode(np.float32([0.25, -3.0])).tolist() == [2_500_000_000, -30_000_000_000]
    # Slot values after summing may use the full int64 range; any block length, several slot counts.
    ints = np.array(
        [
            0,
            -1,
            1,
            np.iinfo(np.int64).min,
            np.iinfo(np.int64).max,
            -(2**62),
            2**62 + 7,
            -5,
            9,
            2**63 - 2,
            -3,
        ],
        dtype=np.int64,
    )
    for slots in (1, 2, 4, 7, 31):
        blocks = pack(ints, slots)
        assert len(blocks) == -(-len(ints) // slots)
        assert unpack(blocks, len(ints), slots).tolist() == ints.tolist()
        expect = [
            sum(int(v) << (64 * i) for i, v in enumerate(ints[j : j + slots]))
            for j in range(0, len(ints), slots)
        ]
        assert blocks == expect  # balanced signed digits, as specified


@pytest.mark.parametrize(
    "bad", [VALUE_BOUND / SCALE, -VALUE_BOUND / SCALE, 1e12, np.nan, np.inf, -np.inf]
)
def test_encode_rejects_out_of_range(bad):
    with pytest.raises(ValueError):
        encode(np.array([0.0, bad]))


def test_encode_rejects_non_vectors_and_unpack_checks_counts():
    with pytest.raises(ValueError):
        encode(np.zeros((2, 2)))
    with pytest.raises(ValueError):
        unpack([0, 0], 3, 1)
    with pytest.raises(ValueError):
        unpack([1 << 200], 2, 2)  # a block too big for its slots


def _chain(backend, keys, vectors):
    c = backend.encrypt(keys.public, vectors[0])
    for v in vectors[1:]:
        c = backend.add(keys.public, c, backend.encrypt(keys.public, v))
    return c


@pytest.mark.parametrize(
    ("peers", "length", "bits"), [(3, 50, 512), (10, 23, 512), (5, 61, 1024), (4, 1, 1024)]
)
def test_packed_chain_decrypts_exactly_to_the_fixed_point_sum(
    peers, length, bits, keys512, keys1024
):
    keys = keys512 if bits == 512 else keys1024
    backend = PaillierBackend(workers=2 if peers == 10 else 1)  # the threaded path too
    slots = backend.slots(keys.public)
    assert slots == (bits - 2) // 64
    assert length == 1 or length % slots != 0  # a short last block
    rng = np.random.default_rng(peers)
    vectors = [rng.normal(scale=10.0 ** rng.integers(-3, 4), size=length) for _ in range(peers)]
    vectors[0][: min(3, length)] = -abs(vectors[0][: min(3, length)])
    cts = _chain(backend, keys, vectors)
    assert len(cts) == -(-length // slots)
    sums, plaintexts = backend.decrypt(keys.private, cts, length)
    exact = sum(encode(v).astype(object) for v in vectors)  # Python ints: no overflow
    assert unpack(_signed(plaintexts, keys.public.n), length, slots).tolist() == list(exact)
    np.testing.assert_allclose(sums, sum(vectors), atol=1e-9, rtol=0)
    np.testing.assert_array_equal(backend.decode(keys.public, plaintexts, length), sums)


def test_unpacked_mode_one_ciphertext_per_value(keys512):
    backend = PaillierBackend(slots_per_ct=1)
    rng = np.random.default_rng(3)
    vectors = [rng.normal(size=9) for _ in range(3)]
    cts = _chain(backend, keys512, vectors)
    assert len(cts) == 9
    sums, plaintexts = backend.decrypt(keys512.private, cts, 9)
    assert _signed(plaintexts, keys512.public.n) == [
        int(x) for x in sum(encode(v).astype(object) for v in vectors)
    ]
    np.testing.assert_allclose(sums, sum(vectors), atol=1e-9, rtol=0)


def test_2048_bit_key_packs_31_slots():
    backend = PaillierBackend()
    keys = backend.generate(2048)
    assert (
        keys.public.n.bit_length() == 2048
        and backend.slots(keys.public) == max_slots(keys.public.n) == 31
    )
    rng = np.random.default_rng(4)
    vectors = [rng.normal(size=70) for _ in range(3)]
    cts = _chain(backend, keys, vectors)
    assert len(cts) == 3
    sums, _ = backend.decrypt(keys.private, cts, 70)
    np.testing.assert_allclose(sums, sum(vectors), atol=1e-9, rtol=0)
    assert backend.to_tensor(keys.public, cts, "ciphertexts").shape == (3, 512)


def test_serialization_round_trips_through_uint8_tensors(keys512):
    backend = PaillierBackend()
    values = np.random.default_rng(5).normal(size=20)
    cts = backend.encrypt(keys512.public, values)
    tensor = backend.to_tensor(keys512.public, cts, "ciphertexts")
    assert tensor.dtype == torch.uint8 and tensor.shape == (len(cts), 128)
    assert backend.from_tensor(keys512.public, tensor.clone(), "ciphertexts") == cts
    pk_tensor = backend.public_key_to_tensor(keys512.public)
    assert pk_tensor.dtype == torch.uint8 and pk_tensor.shape == (64,)
    public = backend.public_key_from_tensor(pk_tensor)
    assert public == keys512.public
    # Ciphertexts made under the deserialized key decrypt with the original private key.
    sums, plaintexts = backend.decrypt(keys512.private, backend.encrypt(public, values), 20)
    np.testing.assert_allclose(sums, values, atol=1e-10, rtol=0)
    pt = backend.to_tensor(public, plaintexts, "plaintexts")
    assert (
        pt.shape == (len(plaintexts), 64)
        and backend.from_tensor(public, pt, "plaintexts") == plaintexts
    )
    assert from_bytes_tensor(to_bytes_tensor([0, 1, 2**64 - 1], 8)) == [0, 1, 2**64 - 1]
    assert to_bytes_tensor([], 8).shape == (0, 8)
    with pytest.raises(ValueError):
        to_bytes_tensor([2**64], 8)
    with pytest.raises(ValueError):
        to_bytes_tensor([-1], 8)
    with pytest.raises(ValueError):
        backend.from_tensor(public, pt, "ciphertexts")  # wrong width
    with pytest.raises(ValueError):
        backend.from_tensor(
            public, torch.full((1, 64), 255, dtype=torch.uint8), "plaintexts"
        )  # >= n


@pytest.mark.parametrize("mode", ["batch", "full"])
def test_decryption_proof_verifies_and_rejects_tampering(mode, keys512):
    backend = PaillierBackend()
    public, n = keys512.public, keys512.public.n
    rng = np.random.default_rng(6)
    cts = _chain(backend, keys512, [rng.normal(size=30) for _ in range(3)])
    _, plaintexts = backend.decrypt(keys512.private, cts, 30)
    proof = backend.decryption_proof(keys512.private, cts)
    assert all(public.raw_encrypt(m, r_value=r) == c for c, m, r in zip(cts, plaintexts, proof))
    assert backend.verify_decryption(public, cts, plaintexts, proof, mode)

    def check(c, m, r):
        return backend.verify_decryption(public, c, m, r, mode)

    for j in (0, len(cts) - 1):
        wrong_m = list(plaintexts)
        wrong_m[j] = (wrong_m[j] + 1) % n
        assert not check(cts, wrong_m, proof)
        wrong_r = list(proof)
        wrong_r[j] = wrong_r[j] * 2 % n
        assert not check(cts, plaintexts, wrong_r)
    swapped = [cts[1], cts[0], *cts[2:]]
    assert not check(swapped, plaintexts, proof)
    # Out of range: m >= n, r = 0, r sharing a factor with n, lengths that differ.
    assert not check(cts, [plaintexts[0] + n, *plaintexts[1:]], proof)
    assert not check(cts, plaintexts, [0, *proof[1:]])
    assert not check(cts, plaintexts, [keys512.private.p, *proof[1:]])
    assert not check(cts, plaintexts[:-1], proof)


def test_backends_registry_and_plaintext_backend_matches_paillier(keys512):
    assert {name: cls.name for name, cls in BACKENDS.items()} == {
        "paillier": "paillier",
        "plaintext": "plaintext",
    }
    rng = np.random.default_rng(7)
    vectors = [rng.normal(size=40).astype(np.float32) for _ in range(4)]
    paillier, plain = PaillierBackend(), PlaintextBackend()
    he_sums, _ = paillier.decrypt(keys512.private, _chain(paillier, keys512, vectors), 40)
    keys = plain.generate()
    assert keys.public is None and keys.private is None
    running = _chain(plain, keys, vectors)
    sums, plaintexts = plain.decrypt(keys.private, running, 40)
    np.testing.assert_allclose(sums, he_sums, atol=1e-9, rtol=0)
    np.testing.assert_array_equal(sums, np.sum([v.astype(np.float64) for v in vectors], axis=0))
    proof = plain.decryption_proof(keys.private, running)
    assert plain.verify_decryption(None, running, plaintexts, proof)
    assert not plain.verify_decryption(None, running, plaintexts + 1e-9, proof)
    wire = plain.to_tensor(None, running, "ciphertexts")
    assert wire.dtype == torch.float64
    np.testing.assert_array_equal(plain.from_tensor(None, wire, "ciphertexts"), running)


def _fields():
    return {
        "C": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
        "S": 2,
        "T": 1.25,
        "L": b"127.0.0.1:1",
        "w": torch.tensor([0.5, -1.0], dtype=torch.float64),
    }


def test_signatures_verify_and_reject_any_change():
    keys, other = SigningKeys.generate(), SigningKeys.generate()
    fields = _fields()
    sig = keys.sign(fields)
    assert len(sig) == 64 and len(keys.public_bytes) == 32
    assert verify(keys.public_bytes, fields, sig)
    assert canonical_bytes(fields) == canonical_bytes(
        dict(reversed(list(fields.items())))
    )  # order-free
    # Flip every byte of every field, one at a time.
    for name, value in fields.items():
        data = (
            value.contiguous().view(torch.uint8).reshape(-1)
            if isinstance(value, torch.Tensor)
            else None
        )
        count = data.numel() if data is not None else 1
        for i in range(count):
            tampered = dict(fields)
            if data is not None:
                flipped = data.clone()
                flipped[i] ^= 0xFF
                tampered[name] = flipped.view(value.dtype).reshape(value.shape)
            elif isinstance(value, bytes):
                tampered[name] = bytes([value[0] ^ 1]) + value[1:]
            else:
                tampered[name] = value + 1
            assert not verify(keys.public_bytes, tampered, sig), (name, i)
    assert not verify(other.public_bytes, fields, sig)
    assert not verify(keys.public_bytes, fields, sig[:-1])
    assert not verify(keys.public_bytes, {**fields, "extra": 0}, sig)
    assert not verify(keys.public_bytes[:31], fields, sig)
    assert not verify(keys.public_bytes, {**fields, "bad": object()}, sig)


def test_canonical_bytes_bind_shape_dtype_and_type():
    t = torch.arange(6, dtype=torch.int32)
    base = canonical_bytes({"x": t})
    assert canonical_bytes({"x": t.reshape(2, 3)}) != base
    assert canonical_bytes({"x": t.view(torch.float32)}) != base  # same bytes, other dtype
    assert canonical_bytes({"x": t.numpy().tobytes()}) != base
    assert canonical_bytes({"x": 1}) != canonical_bytes({"x": 1.0}) != canonical_bytes({"x": True})
    assert canonical_bytes({"a": b"bc"}) != canonical_bytes({"ab": b"c"})
    assert canonical_bytes({"x": t[::2]}) == canonical_bytes(
        {"x": t[::2].clone()}
    )  # non-contiguous views
    assert canonical_bytes({"x": -(2**100)}) != canonical_bytes({"x": 2**100})
