"""Digests of messages and the nodes' Ed25519 signatures over them, for the equivocation
check (`p4bench.engine.equivocation`, whose docstring gives the trust model).

A digest is a 128-bit BLAKE2b of a message's chosen payload entries (with their dtypes and
shapes), as two int64 values. A sender signs a *statement*: a domain tag, the phase, the
exchange, the round, the exchange's occurrence in its block (a method may run an exchange
of the same name several times a round), its own id and the digest, each field length
prefixed or fixed size, so two different statements never encode to the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p4bench.engine.messages import Messages

__all__ = [
    "SIGNATURE_BYTES",
    "NodeKeys",
    "SeedKeys",
    "Statement",
    "first_per",
    "host_field",
    "row_digests",
    "sign_all",
    "statement",
    "verify_all",
]

SIGNATURE_BYTES = 64
_DOMAIN = b"p4bench-equivocation-v1"
Statement = tuple[str, int, str, int]  # phase, round, exchange, occurrence in the block


class NodeKeys(Protocol):
    """Signing keys of the nodes this process holds, and every node's verification key."""

    def sign(self, node: int, data: bytes) -> bytes: ...

    def verify(self, node: int, data: bytes, signature: bytes) -> bool: ...


class SeedKeys:
    """Every node's Ed25519 key, derived from the run seed: the harness's keys, which hold
    for the simulated attacks (equivocation module docstring: trust model)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._private: dict[int, Ed25519PrivateKey] = {}
        self._public: dict[int, Ed25519PublicKey] = {}

    def private_key(self, node: int) -> Ed25519PrivateKey:
        if node not in self._private:
            secret = hashlib.blake2b(
                f"{self.seed}|{node}".encode(), digest_size=32, person=b"p4bench-node-key"
            ).digest()
            self._private[node] = Ed25519PrivateKey.from_private_bytes(secret)
        return self._private[node]

    def public_key(self, node: int) -> Ed25519PublicKey:
        if node not in self._public:
            self._public[node] = self.private_key(node).public_key()
        return self._public[node]

    def sign(self, node: int, data: bytes) -> bytes:
        return self.private_key(node).sign(data)

    def verify(self, node: int, data: bytes, signature: bytes) -> bool:
        try:
            self.public_key(node).verify(signature, data)
        except InvalidSignature:
            return False
        return True


def row_digests(messages: Messages, keys: Sequence[str]) -> torch.Tensor:
    """(table rows, 2) int64 on the host: a 128-bit BLAKE2b of each table row's payload
    entries `keys` (sorted; with their dtypes and shapes), read from the device at once."""
    rows = len(next(iter(messages.table.values()))) if messages.table else 0
    present = sorted(k for k in keys if k in messages.table)
    if not rows or not present:
        return torch.zeros((rows, 2), dtype=torch.int64, device="cpu")
    layout = "|".join(
        f"{k}:{messages.table[k].dtype}:{tuple(messages.table[k].shape[1:])}" for k in present
    ).encode()
    raw = torch.cat(
        [
            messages.table[k].detach().reshape(rows, -1).contiguous().view(torch.uint8)
            for k in present
        ],
        dim=1,
    )
    data = raw.cpu().numpy()
    out = np.empty((rows, 2), dtype=np.int64)
    for row in range(rows):  # hashlib has no batched form; no device sync in the loop
        digest = hashlib.blake2b(layout, digest_size=16)
        digest.update(data[row].tobytes())
        out[row] = np.frombuffer(digest.digest(), dtype=np.int64)
    return torch.from_numpy(out)


def statement(where: Statement, sender: int, digest: Sequence[int]) -> bytes:
    """The bytes a sender signs for `digest` (module docstring)."""
    phase, round_index, exchange, occurrence = where
    head = b"".join(
        struct.pack("<Q", len(f)) + f for f in (_DOMAIN, phase.encode(), exchange.encode())
    )
    return head + struct.pack(
        "<qqqqq", round_index, occurrence, sender, int(digest[0]), int(digest[1])
    )


def sign_all(
    keys: NodeKeys, senders: torch.Tensor, digests: torch.Tensor, where: Statement
) -> torch.Tensor:
    """(n, 64) uint8: each sender's signature over its digest (each distinct pair signed once)."""
    if not len(senders):
        return torch.zeros((0, SIGNATURE_BYTES), dtype=torch.uint8, device="cpu")
    pairs = torch.cat([senders.cpu().unsqueeze(1), digests], dim=1)
    unique, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    signed = [keys.sign(s, statement(where, s, (d0, d1))) for s, d0, d1 in unique.tolist()]
    table = torch.frombuffer(bytearray(b"".join(signed)), dtype=torch.uint8)
    return table.reshape(len(unique), SIGNATURE_BYTES)[inverse]


def verify_all(
    keys: NodeKeys,
    senders: torch.Tensor,
    digests: torch.Tensor,
    signatures: torch.Tensor,
    where: Statement,
) -> torch.Tensor:
    """(n,) bool: each signature is its sender's over its digest (each distinct triple
    checked once: in process, one per sender however many receivers report it)."""
    if not len(senders):
        return torch.zeros(0, dtype=torch.bool, device="cpu")
    rows = torch.cat([senders.cpu().unsqueeze(1), digests, signatures.long()], dim=1)
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    ok = [keys.verify(r[0], statement(where, r[0], r[1:3]), bytes(r[3:])) for r in unique.tolist()]
    return torch.tensor(ok, dtype=torch.bool, device="cpu")[inverse]


def first_per(keys: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the first occurrence of each value of `keys`, in order."""
    order = torch.argsort(keys, stable=True)
    first_sorted = torch.ones(len(keys), dtype=torch.bool, device="cpu")
    first_sorted[1:] = keys[order][1:] != keys[order][:-1]
    first = torch.zeros(len(keys), dtype=torch.bool, device="cpu")
    first[order] = first_sorted
    return first


def host_field(
    messages: Messages, key: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """(n, *shape) entry `key` of every message on the host, or None where the messages
    lack it or have another layout (what a peer sends is untrusted)."""
    value = messages.table.get(key)
    if value is None or value.dtype != dtype or tuple(value.shape[1:]) != shape:
        return None
    return messages.value(key).cpu()
