"""Issue #47, item 1 and the device parts of item 6: deadlines from the exchange's start,
late in 2 of the last K exchanges, extra messages rejected before they are buffered, drops
one peer reports published only when a majority backs them, and the self-reported
accuracy that stands out named beside a median."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import zlib

import numpy as np
import torch

from p4bench.engine.messages import Messages, encode
from p4bench_device.accuracy_check import accuracy_check, accuracy_metrics
from p4bench_device.drop_reports import announced, drop_metrics, split_drops
from p4bench_device.launcher import free_ports
from p4bench_device.liveness import Arrival, SlowPeers, exchange_deadline_s, majority_median
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import KIND_END, KIND_MESSAGE, Limits, dump_json, pack
from p4bench_device.report_schema import SlowDrop
from p4bench_device.tls import client_context, init_tls_dir
from p4bench_device.transport import EPOCH_SHIFT, PeerTransport

MARKER = {"exchange": "x", "round": 0, "phase": "p"}


# -- the deadline -------------------------------------------------------------------------
def test_the_majority_median_needs_a_strict_majority_and_a_minority_cannot_move_it():
    assert majority_median([0.1, None, None]) is None  # 1 of 3 complete: no deadline yet
    assert majority_median([0.1, 0.2, None]) == 0.2  # 2 of 3: the upper median is known
    honest = [0.5, 0.6, 0.7]
    for late in (0.8, 9.0, None, 1e6):  # one late sender of four, however late: the same median
        assert majority_median([*honest, late]) == 0.7
    # one or two senders: the median is the slowest, so nobody is ever past a deadline above it
    assert majority_median([3.0]) == 3.0 and majority_median([0.1, 5.0]) == 5.0


def test_the_deadline_follows_honest_compute_and_the_link():
    limits = Limits(late_peer_grace_s=2.0, late_peer_factor=4.0, slow_peer_rate_bytes_s=1000)
    assert exchange_deadline_s(0, None, limits) is None  # no majority: the exchange timeout only
    assert exchange_deadline_s(0, 0.01, limits) == 2.0  # everyone prompt: the grace
    assert exchange_deadline_s(3000, 0.01, limits) == 5.0  # plus its bytes at the rate
    # a FedAvg server's exchange starts while its clients train for ~3 s: no honest client is late
    assert exchange_deadline_s(0, 3.0, limits) == 12.0
    assert (
        exchange_deadline_s(0, 3.0, Limits(late_peer_factor=2.0, slow_peer_rate_bytes_s=0)) == 6.0
    )


def _late(finished: float | None) -> Arrival:
    return Arrival(finished is not None, 100, 0.1, None, finished, 2.0)


def test_late_in_two_of_the_last_k_exchanges_is_dropped_and_named():
    limits = Limits(slow_peer_exchanges=2, slow_peer_window=3)
    policy = SlowPeers()
    # on time, late, on time, late: 2 of the last 3 -> dropped at the 4th (no reset by the exchange between)
    pattern = [1.0, None, 1.0, 5.0]
    dropped = [policy.judge({"b": _late(f)}, limits, {"seq": i}) for i, f in enumerate(pattern, 1)]
    assert [len(d) for d in dropped] == [0, 0, 0, 1]
    assert dropped[-1][0]["peer"] == "b" and "past its deadline" in dropped[-1][0]["reason"]
    assert "2 of its last 3" in dropped[-1][0]["reason"] and policy.dropped[0]["seq"] == 4
    # late once, then K - 1 on time, then late again: the first fell out of the window
    policy = SlowPeers()
    pattern = [None, 1.0, 1.0, None]
    assert [
        policy.judge({"c": _late(f)}, limits, {"seq": i}) for i, f in enumerate(pattern, 1)
    ] == [[]] * 4
    assert "no end marker by its deadline" in SlowPeers.slow(_late(None), limits)
    assert SlowPeers.slow(Arrival(True, 10, 0.1, None, 0.5, 2.0, extra=3), limits) == (
        "3 extra message(s) beyond the exchange's limit"
    )


# -- on the transport ---------------------------------------------------------------------
@contextlib.contextmanager
def _receiver(tmp_path, names, limits):
    """A transport for names[0] on 127.0.0.1; the others are played by hand over TLS."""
    ports = free_ports(len(names))
    peers = PeersFile(
        tuple(PeerSpec(n, "127.0.0.1", p, i) for i, (n, p) in enumerate(zip(names, ports)))
    )
    init_tls_dir(tmp_path, [(n, ["127.0.0.1"]) for n in names])
    transport = PeerTransport(peers.peers[0], peers, tmp_path, limits)
    transport.start("127.0.0.1", ports[0])
    transport.begin_run("deadline")
    try:
        yield transport, ports[0]
    finally:
        transport.close()


def _tls(tmp_path, port: int, name: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return client_context(tmp_path, name).wrap_socket(raw)


def _seq(seq: int) -> int:
    return (zlib.crc32(b"deadline") & 0xFFFFFF) << EPOCH_SHIFT | seq


def _end(seq: int, count: int = 0) -> bytes:
    return pack(KIND_END, _seq(seq), dump_json({**MARKER, "count": count}))


def _message(src: int, dst: int) -> bytes:
    return encode(
        "x", 0, Messages(torch.tensor([src]), torch.tensor([dst]), {"w": torch.zeros(1, 4)})
    )


def _in_thread(function, *args):
    """`function(*args)` in a thread: (the thread, its result list)."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(function(*args)))
    thread.start()
    return thread, results


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_sender_not_complete_by_its_deadline_is_not_waited_for_and_dropped_at_the_second(
    tmp_path,
):
    # an exchange timeout of 600 s: only the deadline (0.5 s once b, c, d are in) can end these exchanges
    limits = Limits(exchange_timeout_s=600, late_peer_grace_s=0.5, slow_peer_exchanges=2)
    with _receiver(tmp_path, ["a", "b", "c", "d", "late"], limits) as (a, port):
        senders = {name: _tls(tmp_path, port, name) for name in ("b", "c", "d", "late")}
        try:
            for seq in (1, 2):
                for name in ("b", "c", "d"):  # on time; "late" holds its batch back
                    senders[name].sendall(_end(seq))
                thread, results = _in_thread(a.exchange, seq, {}, MARKER, set(senders), set())
                thread.join(60)
                assert results, "the exchange waited past the late sender's deadline"
                assert results[0].absent == {"late"} and set(results[0].received) == {"b", "c", "d"}
                assert [e["peer"] for e in results[0].dropped] == (["late"] if seq == 2 else [])
                senders["late"].sendall(_end(seq))  # it comes after all: the exchange is closed
            reason = a.snapshot()["slow_dropped"][0]["reason"]
            assert "no end marker by its deadline" in reason and "2 of its last 2" in reason
            assert a.snapshot()["refused"] == ["late"]
        finally:
            for sock in senders.values():
                sock.close()


def test_extra_messages_are_rejected_before_they_are_buffered_and_named(tmp_path):
    limits = Limits(exchange_timeout_s=600, slow_peer_exchanges=1)
    with _receiver(tmp_path, ["a", "b", "c"], limits) as (a, port):
        b, c = _tls(tmp_path, port, "b"), _tls(tmp_path, port, "c")
        try:
            # exchange 1: three copies that came ahead of the exchange, trimmed to the limit when it starts
            b.sendall(b"".join(pack(KIND_MESSAGE, _seq(1), _message(1, 0)) for _ in range(3)))
            assert _until(lambda: a.snapshot().get("frames_received", 0) >= 3)
            c.sendall(_end(1))
            b.sendall(_end(1, 3))
            result = a.exchange(1, {}, MARKER, {"b", "c"}, set(), {"b": 1, "c": 1})
            assert (
                len(result.received["b"][1]) == 1
                and a.snapshot()["rejected"]["extra message from b"] == 2
            )
            assert [e["peer"] for e in result.dropped] == [
                "b"
            ] and "2 extra message(s)" in result.dropped[0]["reason"]
            # exchange 2, c: copies sent once the exchange has started are refused before decoding or buffering
            thread, results = _in_thread(a.exchange, 2, {}, MARKER, {"c"}, set(), {"c": 2})
            assert _until(lambda: a.inbound.current_seq == 2)
            c.sendall(
                b"".join(pack(KIND_MESSAGE, _seq(2), _message(2, 0)) for _ in range(50))
                + _end(2, 50)
            )
            thread.join(60)
            assert results and len(results[0].received["c"][1]) == 2
            assert a.snapshot()["rejected"]["extra message from c"] == 48
            assert (
                a.inbound.buffered["c"] == 0
            )  # the two kept were handed over, nothing else was held
        finally:
            b.close()
            c.close()


# -- what the launcher publishes ----------------------------------------------------------
def _drops(reporter: str, *dropped: str) -> list[dict]:
    nodes = {p: i for i, p in enumerate("abcde")}
    return announced(
        reporter, [SlowDrop(p, 3, "train", 1, "upload", "no end marker") for p in dropped], nodes
    )


def test_a_drop_one_peer_reports_is_a_claim_and_one_a_majority_reports_is_a_fact():
    # "e" is slow and dropped by every honest peer; "a" is compromised and claims it dropped b, c, d
    entries = _drops("a", "b", "c", "d") + _drops("b", "e") + _drops("c", "e") + _drops("d", "e")
    confirmed, unconfirmed = split_drops(entries, active=set("abcde"))
    assert {e["peer"] for e in confirmed} == {"e"} and {e["by"] for e in confirmed} == {
        "b",
        "c",
        "d",
    }
    assert all("dropped slow peer e" in e["message"] for e in confirmed)
    assert {e["peer"] for e in unconfirmed} == {"b", "c", "d"} and {
        e["by"] for e in unconfirmed
    } == {"a"}
    assert all(
        "peer a reports it dropped slow peer" in e["message"]
        and "unconfirmed: 1 of 4 other peers" in e["message"]
        for e in unconfirmed
    )
    metrics = drop_metrics(confirmed, unconfirmed)
    assert metrics["device.slow_peers_dropped"] == 1 and metrics["device.e.slow_dropped_by"] == 3
    assert (
        "device.b.slow_dropped_by" not in metrics and metrics["device.slow_drops_unconfirmed"] == 3
    )
    assert metrics["device.b.slow_drop_reports_unconfirmed"] == 1
    # two of four others is no majority yet; the third makes it one
    assert split_drops(_drops("b", "e") + _drops("c", "e"), set("abcde"))[0] == []
    assert (
        len(split_drops(_drops("b", "e") + _drops("c", "e") + _drops("d", "e"), set("abcde"))[0])
        == 3
    )


def test_the_server_peer_of_a_server_method_is_believed_alone():
    # FedAvg: clients' messages go to the server only, so only it sees a client's extra copies
    confirmed, unconfirmed = split_drops(_drops("a", "e"), set("abcde"), trusted=frozenset({"a"}))
    assert [(e["peer"], e["confirmed_by"], e["of"]) for e in confirmed] == [
        ("e", 1, 4)
    ] and unconfirmed == []
    # a client's word about the server is still a claim
    confirmed, unconfirmed = split_drops(_drops("e", "a"), set("abcde"), trusted=frozenset({"a"}))
    assert confirmed == [] and [e["peer"] for e in unconfirmed] == ["a"]


def test_a_self_reported_accuracy_that_stands_out_is_named_beside_a_median():
    nodes = {"server": -1, "0": 0, "1": 1, "2": 2, "3": 3, "4": 4}
    accuracy = np.array([0.88, 0.90, 0.89, 0.91, 1.0])  # peer 4 claims 1.0
    check = accuracy_check(accuracy, nodes)
    assert [o["peer"] for o in check["outliers"]] == ["4"] and "peer 4 reports accuracy 1.0000" in (
        check["outliers"][0]["message"]
    )
    assert check["mean"] > 0.91 and abs(check["mean_without_outliers"] - 0.895) < 1e-9
    assert abs(check["median"] - 0.90) < 1e-9
    metrics = accuracy_metrics(check)
    assert metrics["device.accuracy_outliers"] == 1 and metrics["device.4.accuracy_outlier"] == 1.0
    # honest spread is no outlier; the clients the harness made malicious are left out; too few peers: no band
    assert accuracy_check(np.array([0.82, 0.85, 0.88, 0.86]), nodes)["outliers"] == []
    assert accuracy_check(accuracy, nodes, malicious=[False] * 4 + [True])["outliers"] == []
    assert accuracy_check(np.array([0.5, 0.9, 1.0]), nodes)["outliers"] == []
