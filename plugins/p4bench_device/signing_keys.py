"""Each device peer signs with its own TLS key (`PeerKeys`), for the equivocation check.

The engine's equivocation check (`p4bench.engine.equivocation`) names a sender only on two
valid signatures of its over different digests. Keys derived from the run seed would let
any peer that knows the seed (all of them) sign for an honest peer and frame it. Here a
peer signs with the private key of its own certificate (ECDSA P-256, SHA-256; the
signature as r || s, 64 bytes), which never leaves the machine, and verifies another
node's signature with the public key of the certificate that node's peer presented in a
TLS handshake with this one (verified against the run's CA, its common name the peer's id:
`certificates`, filled by `p4bench_device.tls.identity`). Every peer of a run has
exchanged with every other before it compares reports (the reports go to every peer), so
the key of each node it judges is known; a node whose certificate it has not seen gets no
valid signature (its report is the reporter's word only).
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.tls import certificates

__all__ = ["PeerKeys", "load_signing_key"]

_HALF = 32  # bytes of r and of s on P-256


def load_signing_key(tls_dir: str | Path, name: str) -> ec.EllipticCurvePrivateKey:
    """The private key of `name`'s certificate, read with its TLS files (local peers remove
    their key files once the peer has read them)."""
    key = serialization.load_pem_private_key((Path(tls_dir) / f"{name}.key").read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{name}.key is not an EC key")
    return key


class PeerKeys:
    """This peer's signing key and the other peers' verification keys (module docstring);
    the `p4bench.engine.signed_digests.NodeKeys` of a device peer's network."""

    def __init__(self, me: PeerSpec, peers: PeersFile, key: ec.EllipticCurvePrivateKey) -> None:
        self.me, self._key = me, key
        self.peer_of = {p.node: p.id for p in peers.peers}

    def sign(self, node: int, data: bytes) -> bytes:
        if node != self.me.node:  # a peer holds one node: it never signs for another
            raise ValueError(f"peer {self.me.id} holds node {self.me.node}, not {node}")
        r, s = decode_dss_signature(self._key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(_HALF, "big") + s.to_bytes(_HALF, "big")

    def verify(self, node: int, data: bytes, signature: bytes) -> bool:
        public = self._public_key(node)
        if public is None or len(signature) != 2 * _HALF:
            return False
        der = encode_dss_signature(
            int.from_bytes(signature[:_HALF], "big"), int.from_bytes(signature[_HALF:], "big")
        )
        try:
            public.verify(der, data, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def _public_key(self, node: int) -> ec.EllipticCurvePublicKey | None:
        if node == self.me.node:
            return self._key.public_key()
        der = certificates.get(self.peer_of.get(node, ""))
        if der is None:
            return None
        key = x509.load_der_x509_certificate(der).public_key()
        return key if isinstance(key, ec.EllipticCurvePublicKey) else None
