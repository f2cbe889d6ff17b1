"""What an authenticated push costs an idle device peer: its resident memory before and after.

A peer holding a valid key (peer "1") pushes 3 x 64 MiB of message frames (32 KiB each) at
peer "0" while no run is active, then announces a 512 MiB frame, which must be refused
before any of it is read. An idle peer must not buffer what it cannot use: the target is
at most 50 MB more resident memory after the push (tests/test_device_faults.py checks the
behaviour: the peer stays up and refuses the big frame; the memory figure is measured here,
not asserted in a test, since a loaded machine moves it).

Prints one JSON object (the bench convention's thread count, wall and CPU seconds, peak
RSS of this process, and the peer's RSS before and after) on stdout.

    .venv/bin/python bench/device_push.py
"""

from __future__ import annotations

import json
import os
import resource
import socket
import ssl
import struct
import time

import torch

from p4bench_device.launcher import LocalPeers
from p4bench_device.protocol import KIND_MESSAGE

TARGET_MB = 50.0


def rss_mb(pid: int) -> float:
    """A process's resident memory now (Linux /proc)."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def tls_socket(port: int, tls_dir, name: str) -> ssl.SSLSocket:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(str(tls_dir / "ca.pem"))
    context.load_cert_chain(str(tls_dir / f"{name}.pem"), str(tls_dir / f"{name}.key"))
    return context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=20))


def push(port: int, tls_dir, frames: int = 2048, rounds: int = 3) -> int:
    """Push `rounds` x `frames` message frames of 32 KiB as peer "1"; the bytes pushed."""
    pushed, body = 0, bytes(32 << 10)
    for _ in range(rounds):
        sock = tls_socket(port, tls_dir, "1")
        try:
            for seq in range(frames):
                sock.sendall(struct.pack("!IBBQ", 10 + len(body), 1, KIND_MESSAGE, seq) + body)
                pushed += len(body)
        except OSError:
            pass  # the peer may hang up on a sender that keeps pushing: also fine
        finally:
            sock.close()
    return pushed


def refuses_a_huge_frame(port: int, tls_dir) -> bool:
    """A 512 MiB length field is refused before reading: the peer closes the connection."""
    big = tls_socket(port, tls_dir, "1")
    try:
        big.sendall(struct.pack("!IBBQ", 10 + (512 << 20), 1, KIND_MESSAGE, 1))
        big.settimeout(20)
        return big.recv(1) == b""
    except OSError:
        return True
    finally:
        big.close()


def wait_listening(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # listening, and done warming up (imports)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)


def main() -> None:
    started, cpu_started = time.perf_counter(), time.process_time()
    with LocalPeers(2) as cluster:
        port, pid = cluster.peers.by_id["0"].port, cluster.processes["0"].pid
        wait_listening(port)
        time.sleep(3)
        before = rss_mb(pid)
        pushed = push(port, cluster.tls_dir)
        refused = refuses_a_huge_frame(port, cluster.tls_dir)
        time.sleep(1)
        after = rss_mb(pid)
        alive = cluster.processes["0"].poll() is None
        for process in cluster.processes.values():
            process.terminate()
    print(
        json.dumps(
            {
                "benchmark": "device_push",
                "pushed_mib": round(pushed / 2**20, 1),
                "peer_rss_before_mb": round(before, 1),
                "peer_rss_after_mb": round(after, 1),
                "peer_rss_growth_mb": round(after - before, 1),
                "target_growth_mb": TARGET_MB,
                "meets_target": bool(after - before <= TARGET_MB),
                "peer_alive": alive,
                "huge_frame_refused": refused,
                "torch_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "wall_s": round(time.perf_counter() - started, 2),
                "cpu_s": round(time.process_time() - cpu_started, 2),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
