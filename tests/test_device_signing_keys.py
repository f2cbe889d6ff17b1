"""A device peer signs the equivocation check's digests with its own TLS key (`PeerKeys`),
and verifies another node's signature only with the certificate that node's peer presented."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from p4bench_device import tls
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.signing_keys import PeerKeys, load_signing_key

PEERS = PeersFile(
    (
        PeerSpec("peer-0", "127.0.0.1", 9000, 0),
        PeerSpec("peer-1", "127.0.0.1", 9001, 1),
        PeerSpec("peer-2", "127.0.0.1", 9002, 2),
    )
)


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, PeerKeys]:
    tls.init_tls_dir(tmp_path, [(p.id, ["127.0.0.1"]) for p in PEERS.peers])
    seen = {}  # what a handshake with each peer would have left in `certificates`
    for peer in PEERS.peers:
        pem = (tmp_path / f"{peer.id}.pem").read_bytes()
        seen[peer.id] = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    monkeypatch.setattr(tls, "certificates", seen)
    monkeypatch.setattr("p4bench_device.signing_keys.certificates", seen)
    return {p.id: PeerKeys(p, PEERS, load_signing_key(tmp_path, p.id)) for p in PEERS.peers}


def test_a_peers_signature_verifies_with_its_certificate_only(keys: dict[str, PeerKeys]) -> None:
    signature = keys["peer-1"].sign(1, b"statement")
    assert len(signature) == 64
    assert keys["peer-0"].verify(1, b"statement", signature)
    assert keys["peer-2"].verify(1, b"statement", signature)
    assert not keys["peer-0"].verify(1, b"another statement", signature)
    # what peer 2 signs cannot pass for peer 1's: a compromised peer cannot frame another
    forged = keys["peer-2"].sign(2, b"statement")
    assert not keys["peer-0"].verify(1, b"statement", forged)
    assert keys["peer-0"].verify(2, b"statement", forged)


def test_a_peer_signs_for_its_own_node_only(keys: dict[str, PeerKeys]) -> None:
    with pytest.raises(ValueError, match="holds node 1"):
        keys["peer-1"].sign(2, b"statement")


def test_no_certificate_seen_no_valid_signature(
    keys: dict[str, PeerKeys], monkeypatch: pytest.MonkeyPatch
) -> None:
    signature = keys["peer-1"].sign(1, b"statement")
    monkeypatch.setattr("p4bench_device.signing_keys.certificates", {})
    assert not keys["peer-0"].verify(1, b"statement", signature)
    assert not keys["peer-0"].verify(7, b"statement", signature)  # a node no peer holds
    assert not keys["peer-0"].verify(1, b"statement", signature[:10])
