"""Device runtime pieces in one process: frames, limits, peers files, certificates, the
transport's exchanges and absences, payload checks and the power meter."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
import torch

from p4bench.cli import main
from p4bench.engine.messages import Messages, encode
from p4bench.errors import ConfigError, UsageError
from p4bench_device.launcher import critical_compute_s, free_ports
from p4bench_device.measure import PowerMeter, RoundClock
from p4bench_device.network import check_senders, payload_schema
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import (
    KIND_END,
    KIND_MESSAGE,
    FrameError,
    Limits,
    RejectedFrame,
    dump_json,
    load_json,
    pack,
    read_frame,
)
from p4bench_device.report_schema import Measure
from p4bench_device.tls import init_tls_dir
from p4bench_device.transport import PeerTransport


def _read(data: bytes, max_body: int = 1000):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, max_body)

    return asyncio.run(go())


def test_frames_and_json_bodies():
    assert _read(pack(KIND_END, 7, b"{}")) == (KIND_END, 7, b"{}")
    with pytest.raises(FrameError):  # a length beyond the limit breaks the framing
        _read(pack(KIND_MESSAGE, 1, b"x" * 2000))
    with pytest.raises(RejectedFrame, match="wire version"):
        _read(b"\x00\x00\x00\x0c\x09" + bytes([KIND_END]) + bytes(8) + b"{}")
    with pytest.raises(RejectedFrame, match="unknown frame kind"):
        _read(pack(ord("Q"), 1, b""))
    with pytest.raises(asyncio.IncompleteReadError):
        _read(pack(KIND_END, 1, b"{}")[:-1])
    body = dump_json({"exchange": "probe", "round": 0, "loss": float("nan")})
    assert json.loads(body) == {
        "v": "1",
        "exchange": "probe",
        "round": 0,
        "loss": None,
    }  # NaN never breaks a report
    assert load_json(body, {"exchange": str, "round": int})["exchange"] == "probe"
    for bad in (
        b"[1]",
        b"{",
        b"\xff",
        b'{"v": "2"}',
        json.dumps({"v": "1", "round": True}).encode(),
        json.dumps({"v": "1", "round": "0"}).encode(),
        b'{"v": "1", "round": NaN}',
    ):
        with pytest.raises(RejectedFrame):
            load_json(bad, {"round": int})


def test_limits_from_run_options():
    limits = Limits.from_options(
        {"device_exchange_timeout_s": 5, "device_max_message_mb": 2, "device_retries": 0}
    )
    assert (limits.exchange_timeout_s, limits.max_message_bytes, limits.retries) == (
        5.0,
        2 * 2**20,
        0,
    )
    assert Limits.from_dict(limits.to_dict()) == limits
    for bad in (
        {"device_exchange_timeout_s": -1},
        {"device_retries": "3"},
        {"device_max_message_mb": True},
    ):
        with pytest.raises(ConfigError):
            Limits.from_options(bad)


def test_peers_file_validation(tmp_path):
    peers = PeersFile.parse(
        {
            "peers": [
                {"id": "pi-0", "host": "10.0.0.2", "port": 8443},
                {"id": "pi-1", "host": "10.0.0.3", "port": 8443},
                {"id": "hub", "host": "10.0.0.9", "port": 9000, "role": "server"},
            ]
        }
    )
    assert (
        [p.node for p in peers.peers] == [0, 1, -1]
        and peers.num_clients == 2
        and peers.server.id == "hub"
    )
    assert PeersFile.load(peers.write(tmp_path / "peers.yaml")) == peers
    bad = [
        {
            "peers": [{"id": "a", "host": "h", "port": 1}, {"id": "a", "host": "h", "port": 2}]
        },  # duplicate id
        {"peers": [{"id": "a_b", "host": "h", "port": 1}]},  # not a DNS-style id
        {"peers": [{"id": "launcher", "host": "h", "port": 1}]},  # reserved
        {"peers": [{"id": "a", "host": "h", "port": 70000}]},
        {"peers": [{"id": "a", "host": "h", "port": 1, "client": 1}]},  # clients must be 0..N-1
        {"peers": [{"id": "a", "host": "h", "port": 1, "colour": "red"}]},
        {"peers": [{"id": "a", "host": "h", "port": 1, "role": "server"}]},  # no client at all
        {"nodes": []},
    ]
    for data in bad:
        with pytest.raises(UsageError):
            PeersFile.parse(data)


def test_device_init_writes_a_ca_and_one_certificate_per_node(tmp_path, capsys):
    from cryptography import x509

    peers = PeersFile(
        (PeerSpec("pi-0", "192.168.1.20", 8443, 0), PeerSpec("pi-1", "pi-1.local", 8443, 1))
    ).write(tmp_path / "peers.yaml")
    tls = tmp_path / "tls"
    with pytest.raises(SystemExit) as info:
        main(["device", "init", "--peers", str(peers), "--tls-dir", str(tls)])
    assert info.value.code in (0, None)
    for name in ("ca", "pi-0", "pi-1", "launcher"):
        assert (tls / f"{name}.pem").is_file() and (tls / f"{name}.key").is_file()
        assert os.stat(tls / f"{name}.key").st_mode & 0o077 == 0  # private keys are owner-only
    cert = x509.load_pem_x509_certificate((tls / "pi-1.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value == "pi-1"
    assert "pi-1.local" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:  # an existing CA is never silently replaced
        main(["device", "init", "--peers", str(peers), "--tls-dir", str(tls)])
    assert info.value.code == 2


def _message(src: int, dst: int, **payload: torch.Tensor) -> Messages:
    return Messages(
        torch.tensor([src]), torch.tensor([dst]), {k: v.unsqueeze(0) for k, v in payload.items()}
    )


def test_payload_layouts_are_checked_per_sender_never_by_vote():
    good = [("b", _message(1, 0, w=torch.zeros(3))), ("c", _message(2, 0, w=torch.zeros(3)))]
    flood = [("x", _message(3, 0, w=torch.zeros(4))) for _ in range(5)]  # one sender, many messages
    reference = payload_schema(good[0][1])
    kept, rejected = check_senders(reference, good + flood)  # outnumbered honest senders still pass
    assert (
        kept == [m for _, m in good] and set(rejected) == {"x"} and "5 message(s)" in rejected["x"]
    )
    mixed = [
        ("b", _message(1, 0, w=torch.zeros(3))),
        ("b", _message(1, 0, w=torch.zeros(3, dtype=torch.int64))),
    ]
    kept, rejected = check_senders(
        reference, mixed + good[1:]
    )  # one bad message discredits its sender's batch
    assert kept == [good[1][1]] and set(rejected) == {"b"}
    kept, rejected = check_senders(
        None, good + flood
    )  # undeclared and nothing sent: consistency per sender
    assert len(kept) == 7 and not rejected
    kept, rejected = check_senders(None, mixed)
    assert not kept and set(rejected) == {"b"}


def _transports(tmp_path, names, limits):
    ports = free_ports(len(names))
    peers = PeersFile(
        tuple(PeerSpec(n, "127.0.0.1", p, i) for i, (n, p) in enumerate(zip(names, ports)))
    )
    init_tls_dir(tmp_path, [(n, ["127.0.0.1"]) for n in names])
    out = {}
    for spec in peers.peers:
        out[spec.id] = PeerTransport(spec, peers, tmp_path, limits)
        out[spec.id].start("127.0.0.1", spec.port)
    return peers, out


def test_transport_exchange_absence_and_a_peer_that_leaves(tmp_path):
    limits = Limits(exchange_timeout_s=30, retries=1, backoff_s=0.05)
    peers, nodes = _transports(tmp_path, ["a", "b", "c"], limits)
    for transport in nodes.values():
        transport.begin_run("t")  # data frames are accepted only during a run
    results = {}
    try:

        def exchange(name, seq):
            me = peers.by_id[name]
            frames = {
                other.id: [
                    encode(
                        "x", 0, _message(me.node, other.node, w=torch.full((2,), float(me.node)))
                    )
                ]
                for other in peers.peers
                if other.id != name
            }
            others = {p.id for p in peers.peers} - {name}
            results[(name, seq)] = nodes[name].exchange(
                seq, frames, {"exchange": "x", "round": 0, "phase": "p"}, others, others
            )

        threads = [threading.Thread(target=exchange, args=(n, 1)) for n in "abc"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for name in "abc":
            result = results[(name, 1)]
            assert not result.absent and set(result.received) == {"a", "b", "c"} - {name}
            for sender, (marker, items) in result.received.items():
                assert marker["count"] == 1 and int(items[0][2].src[0]) == peers.by_id[sender].node
        nodes["c"].close()  # c leaves: a and b notice its closed connections instead of timing out
        started = time.monotonic()
        threads = [threading.Thread(target=exchange, args=(n, 2)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert (
            time.monotonic() - started < 25
        )  # below the 30 s exchange timeout: no peer waited it out
        for name in "ab":
            result = results[(name, 2)]
            assert (
                result.absent == {"c"}
                and result.unreachable == {"c"}
                and set(result.received) == {"a", "b"} - {name}
            )
    finally:
        for transport in nodes.values():
            transport.close()


def test_power_meter_command_and_python_sources():
    meter = PowerMeter("echo 4.5 W", interval_s=0.02)
    started = time.perf_counter()
    meter.start()
    time.sleep(0.3)
    meter.stop()
    assert len(meter.samples) >= 2 and meter.mean(started, time.perf_counter()) == pytest.approx(
        4.5
    )
    assert PowerMeter("python:p4bench_device.measure:peak_rss_mb").read() > 1  # a python callable
    assert PowerMeter("false").read() is None  # a failing meter gives no reading, never an error
    with pytest.raises(UsageError):
        PowerMeter("python:no.such.module:watts")
    clock = RoundClock()
    with clock.compute():
        time.sleep(0.01)
    figures = clock.finish(meter)
    assert (
        figures["compute_s"] >= 0.01
        and figures["wall_s"] >= figures["compute_s"]
        and figures["peak_rss_mb"] > 1
    )


def test_compute_segments_and_the_critical_path_of_a_round():
    clock = RoundClock(between_rounds_s=0.5)
    with clock.compute():
        time.sleep(0.02)
    clock.barrier()  # an exchange starts: nothing computed inside it
    clock.barrier()
    with clock.compute():
        time.sleep(0.01)
    figures = clock.finish(None)
    first, empty, last = figures["compute_segments"]
    assert first >= 0.02 and empty == 0 and last >= 0.01 and figures["between_rounds_s"] == 0.5
    # every exchange waits for all peers: each segment lasts as long as the slower peer's
    fast = Measure(between_rounds_s=0.01, compute_segments=(0.02, 0.5, 0.01))
    slow = Measure(between_rounds_s=0.03, compute_segments=(0.04, 0.1, 0.02))
    assert critical_compute_s([fast, slow]) == pytest.approx(0.07 + 0.5 + 0.02)
    assert (
        critical_compute_s([fast, Measure(compute_segments=(0.1,))]) is None
    )  # unequal or missing: no figure
    assert critical_compute_s([fast, Measure()]) is None
    assert critical_compute_s([]) is None
