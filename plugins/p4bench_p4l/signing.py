"""Ed25519 signatures over P4L messages, with a canonical encoding of the signed fields.

Every hop of a synergy signs its message (pk_A, C, S, L, T, ...) with its own signing key;
the sender's 32-byte verification key travels with the message (reference erratum A2),
and the receiver checks it against the key it knows for that peer.

`canonical_bytes` is the exact byte string that is signed: a domain tag, then every field
in sorted key order as (key, type tag, shape, raw little-endian bytes), each part length
prefixed, so that two different field mappings never encode to the same bytes. No pickle,
no JSON of floats.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Mapping

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["DOMAIN_TAG", "Field", "SigningKeys", "canonical_bytes", "verify"]

DOMAIN_TAG = b"p4bench-p4l-v1"
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
Field = torch.Tensor | bytes | int | float
_LEN = struct.Struct("<Q")


def _prefixed(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _field(value: Field) -> tuple[str, tuple[int, ...], bytes]:
    """(type tag, shape, raw bytes) of one field."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError("only dense tensors can be signed")
        flat = value.detach().cpu().contiguous().reshape(-1)
        # view(uint8) reinterprets the elements' memory, whatever the dtype (bfloat16 too).
        raw = (
            flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        )  # an empty tensor has no memory to view
        return str(value.dtype), tuple(value.shape), raw
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        return "bytes", (len(raw),), raw
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "bool", (), bytes([value])
    if isinstance(value, int):
        return "int", (), value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    if isinstance(value, float):
        return "float64", (), struct.pack("<d", value)
    raise TypeError(f"cannot sign a field of type {type(value).__name__}")


def canonical_bytes(fields: Mapping[str, Field]) -> bytes:
    """The deterministic byte encoding of `fields` that is signed. TypeError for an unsupported value."""
    if (
        sys.byteorder != "little"
    ):  # tensors are encoded in native order, which must be little-endian
        raise NotImplementedError("canonical_bytes assumes a little-endian machine")
    parts = [_prefixed(DOMAIN_TAG), _LEN.pack(len(fields))]
    for key in sorted(fields):
        tag, shape, raw = _field(fields[key])
        parts += [
            _prefixed(key.encode("utf-8")),
            _prefixed(tag.encode("ascii")),
            _LEN.pack(len(shape)),
        ]
        parts += [_LEN.pack(d) for d in shape]
        parts.append(_prefixed(raw))
    return b"".join(parts)


class SigningKeys:
    """A peer's Ed25519 signing key pair (separate from its Paillier keys)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_bytes: bytes = private_key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> SigningKeys:
        """A fresh key pair."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, fields: Mapping[str, Field]) -> bytes:
        """The 64-byte signature of `canonical_bytes(fields)`."""
        return self._private.sign(canonical_bytes(fields))


def verify(verification_key: bytes, fields: Mapping[str, Field], signature: bytes) -> bool:
    """Whether `signature` is a valid signature of `fields` under the 32-byte raw `verification_key`.
    Returns False, never raises, for any bad input (key, fields or signature)."""
    try:
        if len(verification_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        Ed25519PublicKey.from_public_bytes(bytes(verification_key)).verify(
            bytes(signature), canonical_bytes(fields)
        )
    except InvalidSignature:
        return False
    except Exception:  # malformed key or fields from the wire: a bad message, not a crash
        return False
    return True
