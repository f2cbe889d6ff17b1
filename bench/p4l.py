"""P4L's smallest synergy on loopback: a 3-peer packed-Paillier chain, swept over parameter count.

Protocol (reference seed-003-p4l.md section 1.3), three peers in threads, each with its own
TCP server on 127.0.0.1; one connection per message, a frame is ``length (u64, big-endian)
| safetensors bytes``, every message signed with the sender's Ed25519 key (its verification
key travels in the frame and is checked against the peer directory):
- A encrypts its vector under its Paillier key and sends the token (pk_A, C, S, L, T) to P1;
- P1 and P2 each verify, encrypt their own vector, add it homomorphically, sign and forward;
  P2 (S = 0) sends the final message (C, L, T) back to A;
- A decrypts, divides by N = 3, proves the decryption (the ciphertexts' randomness) and sends
  (P2's signed final message, plaintexts, randomness) to P1 and P2, which check P2's
  signature, verify the proof (batch mode) and decode the average; it must equal the true
  mean of the three vectors (max abs error < 1e-9).

Figures per parameter count P: e2e_s (A starts encrypting -> both guests hold the verified
average); packed encryption and decryption throughput (values/s); per hop the frame bytes
actually sent and seconds, split into Paillier work (he_s), signatures (sig_s) and the rest
(serialization, sockets: other_s), measured from the sender's start of work to the receiver
holding the frame; the proof and its batch verification; and, on a sample of min(P, 2000)
values in the same run, packed and unpacked encryption (one ciphertext per value) back to back,
and the packing speedup (packed values/s / unpacked values/s on that sample).
Progress goes to stderr; stdout is one JSON object.

    python bench/p4l.py [--params 1000,10000,100000,1000000] [--key-bits 2048] [--workers N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from p4bench_p4l.crypto import PaillierBackend
from p4bench_p4l.signing import SigningKeys, verify

HEADER = struct.Struct("!Q")
MAX_FRAME = 1 << 32
UNPACKED_SAMPLE = 2000
TIMEOUT_S = 1800.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _text(t: torch.Tensor) -> str:
    return t.numpy().tobytes().decode()


def _int(x: int) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.int64)


def _addresses(t: torch.Tensor) -> list[str]:
    return _text(t).split(",")


@dataclass
class Peer:
    """One peer: its TCP server, signing keys, local vector and timings."""

    name: str
    vector: np.ndarray
    keys: SigningKeys = field(default_factory=SigningKeys.generate)
    server: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def addr(self) -> str:
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[key] += time.perf_counter() - start

    def seal(self, fields: dict[str, torch.Tensor]) -> bytes:
        """A signed safetensors frame body (the signature covers every other tensor, vk and sender included)."""
        fields = {
            **fields,
            "from": _bytes(self.addr.encode()),
            "vk": _bytes(self.keys.public_bytes),
        }
        with self.timed("sig"):
            signature = self.keys.sign(fields)
        return st_save({**fields, "sig": _bytes(signature)})

    def open(self, body: bytes, directory: dict[str, bytes]) -> dict[str, torch.Tensor]:
        """Parse a frame body and check its signature against the sender's known key."""
        fields = st_load(body)
        signature = fields.pop("sig").numpy().tobytes()
        vk = fields["vk"].numpy().tobytes()
        with self.timed("sig"):
            ok = directory.get(_text(fields["from"])) == vk and verify(vk, fields, signature)
        if not ok:
            raise ValueError(f"{self.name}: bad signature")
        return fields

    def send(self, addr: str, body: bytes) -> int:
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
            conn.sendall(HEADER.pack(len(body)) + body)
        return HEADER.size + len(body)

    def receive(self) -> tuple[bytes, float]:
        """The next frame body, and when it was fully read."""
        self.server.settimeout(TIMEOUT_S)
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            (size,) = HEADER.unpack(_read_exact(conn, HEADER.size))
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            body = _read_exact(conn, size)
        return body, time.perf_counter()


def _read_exact(conn: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-frame")
        got += n
    return bytes(buf)


@dataclass
class Synergy:
    """One run of the chain: shared state between the peer threads."""

    peers: list[Peer]
    backend: PaillierBackend
    key: Any  # A's Paillier KeyPair
    hops: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, tuple[float, np.ndarray]] = field(default_factory=dict)
    received: dict[tuple[str, str], float] = field(
        default_factory=dict
    )  # (kind, receiver) -> frame fully read
    t0: float = 0.0

    @property
    def directory(self) -> dict[str, bytes]:
        return {p.addr: p.keys.public_bytes for p in self.peers}

    def next_hop(self, route: list[str]) -> str:
        """discover_nearby(exclude=L): the first peer not yet in the chain."""
        return next(p.addr for p in self.peers if p.addr not in route)

    def hop(
        self,
        sender: Peer,
        kind: str,
        target: str,
        body: bytes,
        started: float,
        work: dict[str, float],
    ) -> None:
        size = sender.send(target, body)
        self.hops.append(
            {
                "from": sender.name,
                "to": self._name(target),
                "kind": kind,
                "bytes": size,
                "started": started,
                **{k: round(v, 6) for k, v in work.items()},
            }
        )

    def _name(self, addr: str) -> str:
        return next(p.name for p in self.peers if p.addr == addr)


def _delta(peer: Peer, before: dict[str, float]) -> dict[str, float]:
    return {f"{k}_s": peer.seconds[k] - before.get(k, 0.0) for k in ("he", "sig")}


def initiator(syn: Synergy, a: Peer, count: int) -> None:
    backend, public = syn.backend, syn.key.public
    started, before = time.perf_counter(), dict(a.seconds)
    with a.timed("he"), a.timed("encrypt"):
        cts = backend.encrypt(public, a.vector)
    token = {
        "kind": _bytes(b"token"),
        "pk": backend.public_key_to_tensor(public),
        "C": backend.to_tensor(public, cts, "ciphertexts"),
        "S": _int(len(syn.peers) - 1),
        "L": _bytes(a.addr.encode()),
        "T": torch.tensor([time.time()], dtype=torch.float64),
        "count": _int(count),
    }
    body = a.seal(token)
    syn.hop(a, "token", syn.next_hop([a.addr]), body, started, _delta(a, before))

    final_body, syn.received["final", a.name] = a.receive()
    started, before = time.perf_counter(), dict(a.seconds)
    final = a.open(final_body, syn.directory)
    route = _addresses(final["L"])
    if _text(final["kind"]) != "final" or route[0] != a.addr or len(set(route)) != len(route) < 3:
        raise ValueError("A: malformed final message")
    cts = backend.from_tensor(public, final["C"], "ciphertexts")
    with a.timed("he"), a.timed("decrypt"):
        sums, plaintexts = backend.decrypt(syn.key.private, cts, count)
    a.vector = sums / len(route)  # A's aggregate
    with a.timed("he"), a.timed("proof"):
        randomness = backend.decryption_proof(syn.key.private, cts)
    body = a.seal(
        {
            "kind": _bytes(b"aggregate"),
            "final": _bytes(final_body),
            "L": final["L"],
            "plaintexts": backend.to_tensor(public, plaintexts, "plaintexts"),
            "randomness": backend.to_tensor(public, randomness, "plaintexts"),
            "T": torch.tensor([time.time()], dtype=torch.float64),
        }
    )
    work = _delta(a, before)
    for target in route[1:]:
        syn.hop(a, "aggregate", target, body, started, work)


def guest(syn: Synergy, me: Peer) -> None:
    backend = syn.backend
    body, syn.received["token", me.name] = me.receive()
    started, before = time.perf_counter(), dict(me.seconds)
    token = me.open(body, syn.directory)
    route = _addresses(token["L"])
    if _text(token["kind"]) != "token" or me.addr in route or _text(token["from"]) != route[-1]:
        raise ValueError(f"{me.name}: token dropped")
    public = backend.public_key_from_tensor(token["pk"])
    count, remaining = int(token["count"][0]), int(token["S"][0]) - 1
    cts = backend.from_tensor(public, token["C"], "ciphertexts")
    with me.timed("he"), me.timed("encrypt"):
        own = backend.encrypt(public, me.vector)
    with me.timed("he"):
        cts = backend.add(public, cts, own)
    route.append(me.addr)
    fields = {
        "C": backend.to_tensor(public, cts, "ciphertexts"),
        "L": _bytes(",".join(route).encode()),
        "T": torch.tensor([time.time()], dtype=torch.float64),
        "count": _int(count),
    }
    if remaining == 0:
        target, kind = route[0], "final"
    else:
        target, kind = syn.next_hop(route), "token"
        fields.update({"pk": token["pk"], "S": _int(remaining)})
    body = me.seal({"kind": _bytes(kind.encode()), **fields})
    syn.hop(me, kind, target, body, started, _delta(me, before))

    agg_body, syn.received["aggregate", me.name] = me.receive()
    with me.timed("verify_all"):
        agg = me.open(agg_body, syn.directory)
        if _text(agg["kind"]) != "aggregate" or _text(agg["from"]) != route[0]:
            raise ValueError(f"{me.name}: not A's aggregate")
        final_body = agg["final"].numpy().tobytes()
        final = me.open(
            final_body, syn.directory
        )  # the last guest's signed final message: the real C
        final_route = _addresses(final["L"])
        if (
            _text(final["kind"]) != "final"
            or final_route[: len(route)] != route
            or _text(agg["L"]) != _text(final["L"])
        ):
            raise ValueError(f"{me.name}: final message does not extend my chain")
        cts = backend.from_tensor(public, final["C"], "ciphertexts")
        plaintexts = backend.from_tensor(public, agg["plaintexts"], "plaintexts")
        randomness = backend.from_tensor(public, agg["randomness"], "plaintexts")
        with me.timed("verify_proof"):
            if not backend.verify_decryption(public, cts, plaintexts, randomness, mode="batch"):
                raise ValueError(f"{me.name}: decryption proof rejected")
        average = backend.decode(public, plaintexts, count) / len(final_route)
    syn.done[me.name] = (time.perf_counter(), average)


def _run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as err:  # surfaced in the main thread below
                errors.append(err)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a peer thread did not finish")


def run_size(count: int, key: Any, workers: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(scale=0.1, size=count).astype(np.float32) for _ in range(3)]
    peers = [Peer(name, v) for name, v in zip(("A", "P1", "P2"), vectors)]
    backend = PaillierBackend(workers=workers)
    syn = Synergy(peers, backend, key)
    try:
        syn.t0 = time.perf_counter()
        _run_threads(
            [
                lambda: initiator(syn, peers[0], count),
                lambda: guest(syn, peers[1]),
                lambda: guest(syn, peers[2]),
            ]
        )
    finally:
        for p in peers:
            p.server.close()
    e2e = max(t for t, _ in syn.done.values()) - syn.t0
    mean = np.mean([v.astype(np.float64) for v in vectors], axis=0)
    errors = [float(np.max(np.abs(avg - mean))) for _, avg in syn.done.values()]
    assert len(errors) == 2 and max(errors) < 1e-9, errors
    assert float(np.max(np.abs(peers[0].vector - mean))) < 1e-9

    hops = []
    for h in syn.hops:
        seconds = syn.received[h["kind"], h["to"]] - h.pop("started")
        crypto = h["he_s"] + h["sig_s"]
        hops.append({**h, "seconds": round(seconds, 6), "other_s": round(seconds - crypto, 6)})
    encrypt_s = sum(p.seconds["encrypt"] for p in peers)

    # Packed vs unpacked on the same sample, back to back, so that both see the same machine load.
    sample = vectors[0][: min(count, UNPACKED_SAMPLE)]
    sample_vps = {}
    for slots_per_ct in (None, 1):
        start = time.perf_counter()
        PaillierBackend(slots_per_ct=slots_per_ct, workers=workers).encrypt(key.public, sample)
        sample_vps[slots_per_ct] = len(sample) / (time.perf_counter() - start)
    packed_vps = 3 * count / encrypt_s
    slots = backend.slots(key.public)
    return {
        "params": count,
        "e2e_s": round(e2e, 4),
        "ciphertexts": -(-count // slots),
        "encrypt_values_per_s": round(packed_vps, 1),
        "decrypt_values_per_s": round(count / peers[0].seconds["decrypt"], 1),
        "encrypt_s_per_peer": round(encrypt_s / 3, 4),
        "decrypt_s": round(peers[0].seconds["decrypt"], 4),
        "proof_s": round(peers[0].seconds["proof"], 4),
        "verify_batch_s": round(max(p.seconds["verify_proof"] for p in peers[1:]), 4),
        "guest_verify_all_s": round(max(p.seconds["verify_all"] for p in peers[1:]), 4),
        "chain_bytes_per_param": round(hops[0]["bytes"] / count, 3),
        "hops": hops,
        "total_bytes": sum(h["bytes"] for h in hops),
        "sample": len(sample),
        "sample_packed_encrypt_values_per_s": round(sample_vps[None], 1),
        "unpacked_encrypt_values_per_s": round(sample_vps[1], 1),
        "unpacked_bytes_per_param": 2 * ((key.public.n.bit_length() + 7) // 8),
        "packing_speedup": round(sample_vps[None] / sample_vps[1], 2),
        "max_abs_error": max(errors),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", default="1000,10000,100000,1000000", help="comma-separated parameter counts"
    )
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="threads for big-number work per peer",
    )
    parser.add_argument("--quick", action="store_true", help="params 1000,10000 (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [1000, 10000] if args.quick else [int(s) for s in args.params.split(",")]

    try:
        import gmpy2  # type: ignore[import-untyped]

        gmpy2_version: str | None = gmpy2.version()
    except ImportError:
        gmpy2_version = None
    from phe import util as phe_util  # type: ignore[import-untyped]

    start = time.perf_counter()
    key = PaillierBackend().generate(args.key_bits)
    keygen_s = time.perf_counter() - start
    log(
        f"p4l: {args.key_bits}-bit Paillier key in {keygen_s:.2f} s; {args.workers} worker thread(s)"
    )
    results = []
    for i, count in enumerate(sizes):
        result = run_size(count, key, args.workers, args.seed + i)
        log(
            f"p4l: P={count}: e2e {result['e2e_s']:.2f} s, encrypt {result['encrypt_values_per_s']:.0f} values/s "
            f"(unpacked {result['unpacked_encrypt_values_per_s']:.0f}, x{result['packing_speedup']}), "
            f"{result['hops'][0]['bytes'] / 1e6:.2f} MB per chain hop"
        )
        results.append(result)
    out = {
        "bench": "p4l",
        "peers": 3,
        "transport": "TCP, 127.0.0.1, one connection per message",
        "frame": "safetensors",
        "signature": "Ed25519",
        "key_bits": args.key_bits,
        "keygen_s": round(keygen_s, 3),
        "slots_per_ciphertext": PaillierBackend().slots(key.public),
        "scale": "1e10",
        "workers": args.workers,
        "worker_kind": "threads (gmpy2 releases the GIL)",
        "gmpy2": gmpy2_version is not None,
        "gmpy2_version": gmpy2_version,
        "phe_uses_gmpy2": bool(getattr(phe_util, "HAVE_GMP", False)),
        "proof_verification": "batch (2^-64 soundness on plaintexts)",
        "results": results,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
