"""Issue 47, item 5: every TLS context of the device runtime speaks TLS 1.3 only, and a
peer's per-sender inbound buffer cap is its share of the peer's memory budget (the run's
`--memory-budget`, else 1 GiB), never below what a legitimate exchange needs. Peers run
on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import zlib

import pytest
import torch

from p4bench.cli import main
from p4bench.engine.messages import Messages, encode
from p4bench_device.launcher import free_ports
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import (
    BUFFER_HEADROOM_BYTES,
    BUFFER_MIN_MODELS,
    KIND_END,
    KIND_MESSAGE,
    Limits,
    dump_json,
    pack,
)
from p4bench_device.tls import client_context, init_tls_dir, server_context
from p4bench_device.transport import EPOCH_SHIFT, PeerTransport

MARKER = {"exchange": "x", "round": 0, "phase": "p"}


@contextlib.contextmanager
def _cluster(tmp_path, names, limits, started):
    """Peers `names` on 127.0.0.1, a transport for each of `started`; closed at the end."""
    ports = free_ports(len(names))
    peers = PeersFile(
        tuple(PeerSpec(n, "127.0.0.1", p, i) for i, (n, p) in enumerate(zip(names, ports)))
    )
    init_tls_dir(tmp_path, [(n, ["127.0.0.1"]) for n in names])
    nodes = {}
    try:
        for spec in peers.peers:
            if spec.id in started:
                nodes[spec.id] = PeerTransport(spec, peers, tmp_path, limits)
                nodes[spec.id].start("127.0.0.1", spec.port)
        yield peers, nodes
    finally:
        for transport in nodes.values():
            transport.close()


def _connect(context: ssl.SSLContext, port: int) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        return context.wrap_socket(raw)
    except BaseException:
        raw.close()
        raise


def _tls12_only(context: ssl.SSLContext) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _message(src: int, dst: int, floats: int) -> bytes:
    return encode(
        "x", 0, Messages(torch.tensor([src]), torch.tensor([dst]), {"w": torch.zeros(1, floats)})
    )


def _wire_seq(run_id: str, seq: int) -> int:
    return (zlib.crc32(run_id.encode()) & 0xFFFFFF) << EPOCH_SHIFT | seq


def _buffered(transport: PeerTransport) -> dict[str, int]:
    async def read():
        return {k: v for k, v in transport.inbound.buffered.items() if v}

    return transport._thread.call(read(), timeout=10)


# -- TLS 1.3 only ---------------------------------------------------------------------------


def test_every_context_of_the_device_runtime_is_tls13_only(tmp_path):
    init_tls_dir(tmp_path, [("a", ["127.0.0.1"])])
    for context in (
        server_context(tmp_path, "a"),
        client_context(tmp_path, "a"),
        client_context(tmp_path, "launcher"),
    ):
        assert context.minimum_version == ssl.TLSVersion.TLSv1_3


def test_a_peer_refuses_a_tls12_client_and_accepts_a_tls13_peer(tmp_path):
    with _cluster(tmp_path, ["a", "b"], Limits(), started={"a"}) as (peers, nodes):
        port = peers.by_id["a"].port
        # a client holding a valid certificate of the run but offering TLS 1.2 only
        with pytest.raises(ssl.SSLError):
            _connect(_tls12_only(client_context(tmp_path, "b")), port).close()
        sock = _connect(client_context(tmp_path, "b"), port)
        try:
            assert sock.version() == "TLSv1.3"
            seq = _wire_seq("tls", 1)
            nodes["a"].begin_run("tls")
            sock.sendall(pack(KIND_MESSAGE, seq, _message(1, 0, 10)))
            assert _until(lambda: nodes["a"].snapshot().get("frames_received", 0) == 1)
        finally:
            sock.close()


def test_a_peer_refuses_a_tls12_server(tmp_path):
    """The client side too: a server that speaks TLS 1.2 only fails the peer's handshake."""
    init_tls_dir(tmp_path, [("a", ["127.0.0.1"]), ("b", ["127.0.0.1"])])
    server = _tls12_only(server_context(tmp_path, "b"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            server.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(ssl.SSLError):
            _connect(client_context(tmp_path, "a"), port).close()
        thread.join(10)
        assert errors  # the server saw the handshake fail as well
    finally:
        listener.close()


# -- the per-sender buffer cap from the memory budget ------------------------------------------


def test_the_cap_is_a_share_of_the_memory_budget_never_below_a_legitimate_exchange():
    model = 44 * 1000 * 1000  # the reviewer's 44 MB model
    old_rule = 16 * model  # 704 MB per sender
    assert Limits(buffer_budget_bytes=1 << 60).buffer_caps(model, 2) == (old_rule, 3 * old_rule)
    # the default budget, 1 GiB for all inbound buffers, shared by 2 senders (3 local peers)
    assert Limits().buffer_caps(model, 2)[0] == (1 << 30) // 2
    # a 2 GiB budget on a 4 GiB Pi with 7 senders
    assert Limits(buffer_budget_bytes=2 << 30).buffer_caps(model, 7)[0] == (2 << 30) // 7
    # a budget too small for one exchange: the cap stays at what a legitimate exchange needs
    legitimate = BUFFER_MIN_MODELS * model + BUFFER_HEADROOM_BYTES
    assert Limits(buffer_budget_bytes=1).buffer_caps(model, 15) == (legitimate, 4 * legitimate)
    # ... which is no more than the old rule for tiny models (its 8 MiB floor) either
    assert Limits(buffer_budget_bytes=1).buffer_caps(0, 3)[0] == BUFFER_HEADROOM_BYTES
    assert Limits().buffer_caps(1000, 3)[0] == 8 << 20
    limits = Limits(buffer_budget_bytes=123456)
    assert Limits.from_dict(limits.to_dict()) == limits  # it travels to the peers


def test_a_small_budget_shrinks_the_cap_and_a_sender_beyond_it_is_rejected(tmp_path):
    budget, model = 800 * 1024, 10 * 1024
    limits = Limits(buffer_budget_bytes=budget)
    with _cluster(tmp_path, ["a", "b", "c", "d", "e"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("budget")
        a.set_model_bytes(model)
        per_sender, total = a.buffer_caps()
        assert Limits().buffer_caps(model, 4)[0] == 8 << 20  # without the budget: 8 MiB
        assert (per_sender, total) == (budget // 4, 3 * (budget // 4))
        seq, size = _wire_seq("budget", 1), len(_message(1, 0, 2500))
        b = _connect(client_context(tmp_path, "b"), port)
        others = [_connect(client_context(tmp_path, n), port) for n in ("c", "d", "e")]
        try:
            b.sendall(b"".join(pack(KIND_MESSAGE, seq, _message(1, 0, 2500)) for _ in range(30)))

            def processed() -> bool:
                snapshot = a.snapshot()
                received = snapshot.get("frames_received", 0)
                return received + snapshot["rejected"].get("buffer full", 0) == 30

            assert _until(processed)
            held = _buffered(a)["b"]
            assert per_sender - size < held <= per_sender
            assert a.snapshot()["rejected"]["buffer full"] == 30 - held // size
            # a legitimate exchange of the other senders (a model's worth each) still passes
            for node, sock in zip((2, 3, 4), others):
                sock.sendall(pack(KIND_MESSAGE, seq, _message(node, 0, model // 4)))
                sock.sendall(pack(KIND_END, seq, dump_json({**MARKER, "count": 1})))
            result = a.exchange(1, {}, MARKER, {"c", "d", "e"}, set())
            assert not result.absent
            assert {peer: len(items) for peer, (_, items) in result.received.items()} == {
                "c": 1,
                "d": 1,
                "e": 1,
            }
        finally:
            for sock in [b, *others]:
                sock.close()


def test_a_tiny_memory_budget_still_runs_a_device_run(capsys, tmp_path):
    """`--memory-budget` becomes the peers' inbound budget; far below one model per sender,
    the floor keeps a legitimate FedAvg round on 3 local peers (and their server) going."""
    args = [
        "run",
        "--runtime",
        "device",
        "--local-peers",
        "3",
        "--method",
        "fedavg",
        "--rounds",
        "1",
        "--dataset",
        "digits",
        "--memory-budget",
        "0.00001",
        "--results-dir",
        str(tmp_path),
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["accuracy_per_client"] and not summary["device"]["dropped"]
    transports = {peer: s["transport"] for peer, s in summary["device"]["peers"].items()}
    assert set(transports) == {"0", "1", "2", "server"}
    assert all(t["rejected"] == {} and t["frames_received"] > 0 for t in transports.values())


def test_the_run_memory_budget_becomes_the_peers_buffer_budget(monkeypatch):
    from p4bench.config import RunConfig
    from p4bench.host.manager import default_registry
    from p4bench.run.runner import prepare
    from p4bench_device import runtime

    sent: list[Limits] = []

    class Cluster:
        peers, tls_dir, check, forget_keys = None, "", None, None

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Launcher:
        def __init__(self, peers, tls_dir, limits, **kwargs):
            sent.append(limits)

        def run(self, job, on_round):
            return None

    monkeypatch.setattr(runtime, "LocalPeers", Cluster)
    monkeypatch.setattr(runtime, "Launcher", Launcher)
    for budget, expected in ((None, 1 << 30), (0.25, 1 << 28)):
        config = RunConfig(
            method="fedavg",
            clients=3,
            rounds=1,
            runtime="device",
            memory_budget_gb=budget,
            options={"device_local_peers": 3},
        )
        job = prepare(config, default_registry()).job
        runtime.DeviceRuntime().execute(job, lambda report: None)
        assert sent[-1].buffer_budget_bytes == expected
