"""The synergy chain's view of a crypto backend: model vectors in, payload tensors out.

Tokens carry the running sum and the initiator's public key as tensors (safetensors
frames on devices); this adapter turns them into the backend's values and back, caching
parsed public keys. Everything a peer receives is parsed with range checks: a malformed
value makes the token invalid (`ValueError`), never a crash of the peer.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from p4bench_p4l.crypto import BACKENDS, KeyPair

BACKEND_NAMES = tuple(BACKENDS)
KEY_BITS = (512, 1024, 2048, 3072)


class ChainCrypto:
    """Backend `name` ("paillier" | "plaintext") for vectors of `num_values` values."""

    def __init__(self, name: str, key_bits: int, num_values: int) -> None:
        self.name, self.key_bits, self.num_values = name, key_bits, num_values
        # big-number work in threads: gmpy2 releases the GIL (about 2x on two cores)
        self.backend = BACKENDS[name](workers=min(4, os.cpu_count() or 1))
        self._publics: dict[bytes, Any] = {}

    def keypair(self) -> KeyPair:
        return self.backend.generate(self.key_bits)

    def public_tensor(self, keys: KeyPair) -> torch.Tensor:
        return self.backend.public_key_to_tensor(keys.public)

    def _public(self, tensor: torch.Tensor) -> Any:
        key = bytes(tensor.numpy().tobytes())
        if key not in self._publics:
            self._publics[key] = self.backend.public_key_from_tensor(tensor)
        return self._publics[key]

    def _values(self, values: torch.Tensor) -> Any:
        if values.shape != (self.num_values,):
            raise ValueError(f"expected {self.num_values} values, got shape {tuple(values.shape)}")
        return values.double().numpy()

    def encrypt(self, public_tensor: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The encrypted vector (the first running sum) under the key in `public_tensor`."""
        public = self._public(public_tensor)
        return self.backend.to_tensor(
            public, self.backend.encrypt(public, self._values(values)), "ciphertexts"
        )

    def add(
        self, public_tensor: torch.Tensor, running: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """`running` plus the encryption of `values` (a hop's homomorphic addition)."""
        public = self._public(public_tensor)
        current = self.backend.from_tensor(public, running, "ciphertexts")
        added = self.backend.add(
            public, current, self.backend.encrypt(public, self._values(values))
        )
        return self.backend.to_tensor(public, added, "ciphertexts")

    def open(self, keys: KeyPair, running: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(plaintexts, proof) of a final running sum, by its initiator: the decryption and
        the Paillier randomness that lets every member re-encrypt and compare."""
        backend, public = self.backend, keys.public
        ciphertexts = backend.from_tensor(public, running, "ciphertexts")
        _, plaintexts = backend.decrypt(keys.private, ciphertexts, self.num_values)
        proof = backend.decryption_proof(keys.private, ciphertexts)
        return backend.to_tensor(public, plaintexts, "plaintexts"), backend.to_tensor(
            public, proof, "plaintexts"
        )

    def decode(self, keys: KeyPair, plaintexts: torch.Tensor) -> torch.Tensor:
        """The float64 sum vector of the initiator's own decryption."""
        public = keys.public
        raw = self.backend.from_tensor(public, plaintexts, "plaintexts")
        return torch.from_numpy(self.backend.decode(public, raw, self.num_values))

    def verify(
        self,
        public_tensor: torch.Tensor,
        running: torch.Tensor,
        plaintexts: torch.Tensor,
        proof: torch.Tensor,
    ) -> torch.Tensor | None:
        """The float64 sum vector if `plaintexts` provably decrypt `running`, else None."""
        backend = self.backend
        try:
            public = self._public(public_tensor)
            ciphertexts = backend.from_tensor(public, running, "ciphertexts")
            plain = backend.from_tensor(public, plaintexts, "plaintexts")
            randomness = backend.from_tensor(public, proof, "plaintexts")
            if len(plain) != len(ciphertexts) or not backend.verify_decryption(
                public, ciphertexts, plain, randomness
            ):
                return None
            return torch.from_numpy(backend.decode(public, plain, self.num_values))
        except (ValueError, TypeError, IndexError):
            return None
