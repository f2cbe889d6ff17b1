"""Additive homomorphic encryption for P4L synergy chains: packed Paillier and a plaintext stand-in.

Values travel as packed fixed-point integers (`p4bench_p4l.fixed_point`, re-exported here).

Verifiable decryption (the reference's Pi_Res): Paillier lets the key owner extract each
ciphertext's randomness r (c = (1+n)^m r^n mod n^2), and anyone can check (m, r) against c.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import gmpy2  # type: ignore[import-untyped]
import numpy as np
import torch
from numpy.typing import NDArray
from phe import paillier  # type: ignore[import-untyped]

from p4bench_p4l.fixed_point import (  # re-exported: defined here before
    MAX_SUMMANDS,
    SCALE,
    SLOT_BITS,
    VALUE_BOUND,
    decode,
    encode,
    from_bytes_tensor,
    max_slots,
    pack,
    to_bytes_tensor,
    unpack,
)

__all__ = [
    "SCALE",
    "SLOT_BITS",
    "MAX_SUMMANDS",
    "VALUE_BOUND",
    "KeyPair",
    "CryptoBackend",
    "PaillierBackend",
    "PlaintextBackend",
    "BACKENDS",
    "encode",
    "decode",
    "pack",
    "unpack",
    "max_slots",
    "to_bytes_tensor",
    "from_bytes_tensor",
    "decryption_proof",
    "verify_decryption",
]

C = TypeVar("C")
T = TypeVar("T")
Kind = Literal["ciphertexts", "plaintexts"]


def _parallel(
    fn: Callable[[Sequence[Any]], list[T]], items: Sequence[Any], workers: int
) -> list[T]:
    """fn over contiguous chunks of items in `workers` threads (results in order)."""
    if workers <= 1 or len(items) < 2:
        return fn(items)
    size = math.ceil(len(items) / workers)

    def run(chunk: Sequence[Any]) -> list[T]:
        # gmpy2 keeps the GIL by default (the setting is per thread); releasing it lets big powmods run in parallel.
        gmpy2.get_context().allow_release_gil = True
        return fn(chunk)

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(run, [items[i : i + size] for i in range(0, len(items), size)]))
    return [y for part in parts for y in part]


def decryption_proof(private: Any, ciphertexts: Sequence[int], workers: int = 1) -> list[int]:
    """Randomness r_j of each ciphertext, from the private key. Since c = (1+n)^m r^n, c' = c (1 - n m)
    = r^n mod n^2, and c' = c mod n, so r = (c mod n)^(n^-1 mod phi(n)) mod n, computed mod p and q (CRT)."""
    n, p, q = private.public_key.n, gmpy2.mpz(private.p), gmpy2.mpz(private.q)
    dp, dq, p_inv = gmpy2.invert(n, p - 1), gmpy2.invert(n, q - 1), gmpy2.invert(p, q)

    def chunk(cs: Sequence[int]) -> list[int]:
        out = []
        for c in cs:
            rp, rq = gmpy2.powmod(c % p, dp, p), gmpy2.powmod(c % q, dq, q)
            out.append(int(rp + p * ((rq - rp) * p_inv % q)))
        return out

    return _parallel(chunk, list(ciphertexts), workers)


def _in_range(
    n: int, ciphertexts: Sequence[int], plaintexts: Sequence[int], randomness: Sequence[int]
) -> bool:
    if not len(ciphertexts) == len(plaintexts) == len(randomness):
        return False
    n2 = n * n
    return all(
        0 < c < n2 and 0 <= m < n and 0 < r < n and math.gcd(r, n) == 1 and math.gcd(c, n) == 1
        for c, m, r in zip(ciphertexts, plaintexts, randomness)
    )


def verify_decryption(
    public: Any,
    ciphertexts: Sequence[int],
    plaintexts: Sequence[int],
    randomness: Sequence[int],
    mode: Literal["batch", "full"] = "batch",
    workers: int = 1,
) -> bool:
    """Whether each c_j is the encryption of m_j with randomness r_j under `public`.

    "full" re-encrypts every (m_j, r_j): one n-th power mod n^2 per ciphertext. "batch" draws random
    64-bit e_j and checks prod c_j^e_j == (1+n)^(sum e_j m_j) * (prod r_j^e_j)^n mod n^2: short powers
    per ciphertext and one full-size one in all. A wrong plaintext passes with probability <= 2**-64
    (n has no small factors, so sum e_j (m'_j - m_j) = 0 mod n needs a lucky e). The randomness is
    bound only up to factors of small order (e.g. n - r_j passes for even e_j): those are encryptions
    of 0, so the plaintexts, which are what the proof is for, are still bound.
    """
    n = public.n
    if not _in_range(n, ciphertexts, plaintexts, randomness):
        return False
    triples = list(zip(ciphertexts, plaintexts, randomness))
    if mode == "full":
        ok = _parallel(
            lambda ts: [public.raw_encrypt(int(m), r_value=int(r)) == c for c, m, r in ts],
            triples,
            workers,
        )
        return all(ok)
    if mode != "batch":
        raise ValueError(f"unknown mode {mode!r}")
    n_mpz = gmpy2.mpz(n)
    n2 = n_mpz * n_mpz

    def chunk(ts: Sequence[tuple[int, int, int]]) -> list[tuple[Any, Any, int]]:
        lhs, rprod, total = gmpy2.mpz(1), gmpy2.mpz(1), 0
        for c, m, r in ts:
            e = secrets.randbits(64)
            lhs = lhs * gmpy2.powmod(c, e, n2) % n2
            rprod = (
                rprod * gmpy2.powmod(r, e, n_mpz) % n_mpz
            )  # r = r' mod n gives r^n = r'^n mod n^2
            total += e * m
        return [(lhs, rprod, total)]

    lhs, rprod, total = gmpy2.mpz(1), gmpy2.mpz(1), 0
    for part_lhs, part_r, part_total in _parallel(chunk, triples, workers):
        lhs, rprod, total = lhs * part_lhs % n2, rprod * part_r % n_mpz, total + part_total
    rhs = (
        (1 + n_mpz * (total % n_mpz)) * gmpy2.powmod(rprod, n_mpz, n2) % n2
    )  # (1+n)^s = 1 + n s mod n^2
    return bool(lhs == rhs)


@dataclass(frozen=True)
class KeyPair:
    """A backend's key pair: phe PaillierPublicKey / PaillierPrivateKey, None for the plaintext backend."""

    public: Any
    private: Any


class CryptoBackend(ABC, Generic[C]):
    """What the synergy chain needs from an additive encryption scheme. C is the container of
    ciphertexts, and also of plaintexts and decryption proofs (the decrypted values before decoding)."""

    name: str

    def __init__(self, *, slots_per_ct: int | None = None, workers: int = 1) -> None:
        """slots_per_ct: values per ciphertext (None: as many as the key allows);
        workers: threads for big-number work."""
        if slots_per_ct is not None and slots_per_ct < 1:
            raise ValueError("slots_per_ct must be >= 1")
        self.slots_per_ct, self.workers = slots_per_ct, max(1, workers)

    @abstractmethod
    def generate(self, key_bits: int = 2048) -> KeyPair:
        """A fresh key pair."""

    @abstractmethod
    def slots(self, public: Any) -> int:
        """Values per ciphertext under `public`."""

    @abstractmethod
    def encrypt(self, public: Any, values: np.ndarray) -> C:
        """Encrypt a 1-D float vector (fixed point, packed)."""

    @abstractmethod
    def add(self, public: Any, a: C, b: C) -> C:
        """Homomorphic sum of two encrypted vectors."""

    @abstractmethod
    def decrypt(self, private: Any, ciphertexts: C, count: int) -> tuple[np.ndarray, C]:
        """(float64 sum of the `count` values, the raw plaintexts)."""

    @abstractmethod
    def decode(self, public: Any, plaintexts: C, count: int) -> np.ndarray:
        """The float64 sums of raw plaintexts (what a verifier of the decryption computes)."""

    @abstractmethod
    def decryption_proof(self, private: Any, ciphertexts: C) -> C:
        """A proof that `decrypt` was honest."""

    @abstractmethod
    def verify_decryption(
        self,
        public: Any,
        ciphertexts: C,
        plaintexts: C,
        proof: C,
        mode: Literal["batch", "full"] = "batch",
    ) -> bool:
        """Whether `plaintexts` are the decryption of `ciphertexts`, per `proof`."""

    @abstractmethod
    def to_tensor(self, public: Any, values: C, kind: Kind) -> torch.Tensor:
        """Ciphertexts or plaintexts/proofs as a tensor for a safetensors frame."""

    @abstractmethod
    def from_tensor(self, public: Any, tensor: torch.Tensor, kind: Kind) -> C:
        """Inverse of `to_tensor`, validating the shape and range."""

    @abstractmethod
    def public_key_to_tensor(self, public: Any) -> torch.Tensor:
        """The public key as a uint8 tensor."""

    @abstractmethod
    def public_key_from_tensor(self, tensor: torch.Tensor) -> Any:
        """Inverse of `public_key_to_tensor`."""


def _key_bytes(public: Any) -> int:
    return (int(public.n).bit_length() + 7) // 8


class PaillierBackend(CryptoBackend[list[int]]):
    """Packed Paillier (python-paillier with gmpy2); ciphertexts are raw ints mod n^2."""

    name = "paillier"

    def generate(self, key_bits: int = 2048) -> KeyPair:
        public, private = paillier.generate_paillier_keypair(n_length=key_bits)
        return KeyPair(public, private)

    def slots(self, public: Any) -> int:
        top = max_slots(public.n)
        return top if self.slots_per_ct is None else min(self.slots_per_ct, top)

    def encrypt(self, public: Any, values: np.ndarray) -> list[int]:
        n = public.n
        plain = [x % n for x in pack(encode(values), self.slots(public))]  # negatives as n - |X|
        return _parallel(lambda ms: [public.raw_encrypt(m) for m in ms], plain, self.workers)

    def add(self, public: Any, a: list[int], b: list[int]) -> list[int]:
        if len(a) != len(b):
            raise ValueError(f"cannot add {len(a)} ciphertexts to {len(b)}")
        n2 = gmpy2.mpz(public.nsquare)
        return [int(gmpy2.mpz(x) * y % n2) for x, y in zip(a, b)]

    def decrypt(
        self, private: Any, ciphertexts: list[int], count: int
    ) -> tuple[np.ndarray, list[int]]:
        plaintexts = _parallel(
            lambda cs: [private.raw_decrypt(int(c)) for c in cs], ciphertexts, self.workers
        )
        return self.decode(private.public_key, plaintexts, count), plaintexts

    def decode(self, public: Any, plaintexts: list[int], count: int) -> np.ndarray:
        n = public.n
        if not all(0 <= m < n for m in plaintexts):
            raise ValueError("plaintexts must lie in [0, n)")
        signed = [m - n if m > n // 2 else m for m in plaintexts]
        return decode(unpack(signed, count, self.slots(public)))

    def decryption_proof(self, private: Any, ciphertexts: list[int]) -> list[int]:
        return decryption_proof(private, ciphertexts, self.workers)

    def verify_decryption(
        self,
        public: Any,
        ciphertexts: list[int],
        plaintexts: list[int],
        proof: list[int],
        mode: Literal["batch", "full"] = "batch",
    ) -> bool:
        return verify_decryption(public, ciphertexts, plaintexts, proof, mode, self.workers)

    def to_tensor(self, public: Any, values: list[int], kind: Kind) -> torch.Tensor:
        return to_bytes_tensor(values, _key_bytes(public) * (2 if kind == "ciphertexts" else 1))

    def from_tensor(self, public: Any, tensor: torch.Tensor, kind: Kind) -> list[int]:
        width, bound = (
            (2 * _key_bytes(public), public.nsquare)
            if kind == "ciphertexts"
            else (_key_bytes(public), public.n)
        )
        if tensor.ndim != 2 or tensor.shape[1] != width:
            raise ValueError(f"{kind}: expected width {width}, got shape {tuple(tensor.shape)}")
        values = from_bytes_tensor(tensor)
        if not all(v < bound for v in values):
            raise ValueError(f"{kind} out of range")
        return values

    def public_key_to_tensor(self, public: Any) -> torch.Tensor:
        return to_bytes_tensor([public.n], _key_bytes(public))[0]

    def public_key_from_tensor(self, tensor: torch.Tensor) -> Any:
        (n,) = from_bytes_tensor(tensor.reshape(1, -1))
        if n < 3 or n % 2 == 0:
            raise ValueError("not a Paillier modulus")
        return paillier.PaillierPublicKey(n)


class PlaintextBackend(CryptoBackend[NDArray[np.float64]]):
    """The same chain with no encryption: "ciphertexts" are the exact float64 running sum (fast sweeps,
    and the unquantized side of the reference's HE-vs-plaintext comparison R10). No privacy."""

    name = "plaintext"

    def generate(self, key_bits: int = 2048) -> KeyPair:
        return KeyPair(None, None)

    def slots(self, public: Any) -> int:
        return 1

    def encrypt(self, public: Any, values: np.ndarray) -> NDArray[np.float64]:
        out = np.array(values, dtype=np.float64)
        if out.ndim != 1 or not np.all(np.isfinite(out)):
            raise ValueError("expected a finite 1-D vector")
        return out

    def add(
        self, public: Any, a: NDArray[np.float64], b: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        if a.shape != b.shape:
            raise ValueError(f"cannot add shapes {a.shape} and {b.shape}")
        return a + b

    def decrypt(
        self, private: Any, ciphertexts: NDArray[np.float64], count: int
    ) -> tuple[np.ndarray, NDArray[np.float64]]:
        return ciphertexts[:count].copy(), ciphertexts.copy()

    def decode(self, public: Any, plaintexts: NDArray[np.float64], count: int) -> np.ndarray:
        return np.asarray(plaintexts[:count], dtype=np.float64)

    def decryption_proof(
        self, private: Any, ciphertexts: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        return np.empty(0)  # nothing to prove: the "ciphertext" is the sum itself

    def verify_decryption(
        self,
        public: Any,
        ciphertexts: NDArray[np.float64],
        plaintexts: NDArray[np.float64],
        proof: NDArray[np.float64],
        mode: Literal["batch", "full"] = "batch",
    ) -> bool:
        return proof.size == 0 and bool(np.array_equal(ciphertexts, plaintexts))

    def to_tensor(self, public: Any, values: NDArray[np.float64], kind: Kind) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=np.float64))

    def from_tensor(self, public: Any, tensor: torch.Tensor, kind: Kind) -> NDArray[np.float64]:
        if tensor.dtype != torch.float64 or tensor.ndim != 1:
            raise ValueError(f"{kind}: expected a 1-D float64 tensor")
        return tensor.numpy().copy()

    def public_key_to_tensor(self, public: Any) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def public_key_from_tensor(self, tensor: torch.Tensor) -> Any:
        return None


BACKENDS: dict[str, type[CryptoBackend[Any]]] = {
    "paillier": PaillierBackend,
    "plaintext": PlaintextBackend,
}
