"""A run's certificate authority, per-peer certificates and TLS contexts.

`p4bench device init` creates one CA per deployment and one certificate per peer (and
one for the launcher), signed by it. Every connection is mutually authenticated: both
ends present a certificate of the run's CA, and the certificate's common name is the
node's identity (its peer id, or ``launcher``). Nothing signed by another CA, and no
connection without a certificate, gets past the handshake. Every context, server and
client side, of the launcher and of the peers, speaks TLS 1.3 only: a TLS 1.2 client or
server fails the handshake.

Files in the TLS folder: ``ca.pem`` (every node), ``ca.key`` (keep it on the machine
that runs `init`; it is not needed to run), ``<id>.pem`` and ``<id>.key`` (one pair per
node, copied to that node only).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p4bench.errors import UsageError

if TYPE_CHECKING:
    from cryptography import x509

__all__ = [
    "LAUNCHER",
    "init_tls_dir",
    "server_context",
    "client_context",
    "certificates",
    "common_name",
    "identity",
    "IdentityError",
]

LAUNCHER = "launcher"


class IdentityError(ConnectionError):
    """The other end presented a valid certificate of the run, but not the expected one."""


def _names(host: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write a file; a private one is created 0600 (no moment with wider permissions),
    and one that existed (an --overwrite) is narrowed before its new bytes go in."""
    if not private:
        path.write_bytes(data)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def init_tls_dir(
    folder: str | Path,
    nodes: Iterable[tuple[str, Iterable[str]]],
    days: int = 30,
    overwrite: bool = False,
) -> list[Path]:
    """Create the CA and one certificate per node (name, hosts it is reached at), plus
    the launcher's. Returns the written files. Refuses to overwrite an existing CA
    unless `overwrite` (a new CA invalidates every certificate of the old one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new folder holding keys: owner only
    if (folder / "ca.pem").exists() and not overwrite:
        raise UsageError(
            f"{folder / 'ca.pem'} exists; pass --overwrite to replace the run's CA and every certificate"
        )
    if days < 1:
        raise UsageError(f"--days must be >= 1, got {days}")
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    pem = serialization.Encoding.PEM

    def key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p4bench run CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    written = [folder / "ca.pem", folder / "ca.key"]
    _write(written[0], ca_cert.public_bytes(pem), private=False)
    _write(written[1], key_bytes(ca_key), private=True)

    entries = dict(nodes)
    entries.setdefault(LAUNCHER, [])
    for name, hosts in entries.items():
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [x509.DNSName(name)] + [_names(h) for h in sorted(set(hosts))]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(folder / f"{name}.pem", cert.public_bytes(pem), private=False)
        _write(folder / f"{name}.key", key_bytes(key), private=True)
        written += [folder / f"{name}.pem", folder / f"{name}.key"]
    return written


def _files(folder: str | Path, name: str) -> tuple[Path, Path, Path]:
    folder = Path(folder)
    paths = folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}.key"
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UsageError(
            f"TLS files missing for '{name}': {', '.join(missing)} (create them with `p4bench device init`)"
        )
    return paths


def _context(purpose: ssl.Purpose, folder: str | Path, name: str) -> ssl.SSLContext:
    ca, cert, key = _files(folder, name)
    context = ssl.SSLContext(
        ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # launcher and peers: TLS 1.3 only
    try:
        context.load_verify_locations(cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(f"cannot load TLS files for '{name}' from {folder}: {exc}") from None
    # Identity is the certificate's common name, checked after the handshake against the
    # peers file, so peers may move between addresses without new certificates.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_context(folder: str | Path, name: str) -> ssl.SSLContext:
    """TLS server context of node `name`: requires a client certificate of the run's CA."""
    return _context(ssl.Purpose.CLIENT_AUTH, folder, name)


def client_context(folder: str | Path, name: str) -> ssl.SSLContext:
    """TLS client context of node `name`: presents its certificate, verifies the server's."""
    return _context(ssl.Purpose.SERVER_AUTH, folder, name)


# peer id -> the DER certificate it presented in this process's latest verified handshake
# with it (the handshake checked it against the run's CA): its key verifies the peer's
# signatures (`p4bench_device.signing_keys`)
certificates: dict[str, bytes] = {}


def identity(writer: Any) -> str | None:
    """The common name of the other end's verified certificate (an asyncio stream writer's
    TLS connection); the certificate is kept in `certificates` under that name."""
    name = common_name(writer.get_extra_info("peercert"))
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if name is not None and der:
        certificates[name] = der
    return name


def common_name(peercert: dict[str, Any] | None) -> str | None:
    """The subject common name of a verified peer certificate (``getpeercert()`` form)."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
