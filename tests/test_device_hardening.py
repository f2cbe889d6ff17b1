"""The device transport under hostile or careless traffic (issue 16): connection floods
before authentication, too many connections of one identity, idle and trickling
connections, data pushed to an idle peer, buffers during a run, peers the launcher
dropped, and per-run counters. Everything runs on 127.0.0.1 within a few seconds."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
import threading
import time
import zlib

import pytest
import torch

from p4bench.engine.messages import Messages, encode
from p4bench_device.admission import HandshakeBudget
from p4bench_device.launcher import free_ports
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import KIND_END, KIND_MESSAGE, Limits, dump_json, load_json, pack
from p4bench_device.tls import client_context, init_tls_dir
from p4bench_device.transport import EPOCH_SHIFT, EVENT_RECONNECTED, LauncherLink, PeerTransport

MARKER = {"exchange": "x", "round": 0, "phase": "p"}


@contextlib.contextmanager
def _cluster(tmp_path, names, limits, started=None):
    """Peers `names` on 127.0.0.1 (a transport for each of `started`, default all); closed at the end."""
    ports = free_ports(len(names))
    peers = PeersFile(
        tuple(PeerSpec(n, "127.0.0.1", p, i) for i, (n, p) in enumerate(zip(names, ports)))
    )
    init_tls_dir(tmp_path, [(n, ["127.0.0.1"]) for n in names])
    nodes = {}
    try:
        for spec in peers.peers:
            if started is None or spec.id in started:
                nodes[spec.id] = PeerTransport(spec, peers, tmp_path, limits)
                nodes[spec.id].start("127.0.0.1", spec.port)
        yield peers, nodes
    finally:
        for transport in nodes.values():
            transport.close()


def _tls(tmp_path, port: int, name: str) -> ssl.SSLSocket:
    """A blocking TLS connection to 127.0.0.1:port with the certificate of `name`."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return client_context(tmp_path, name).wrap_socket(raw)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """True when the other end closes `sock` within `within` seconds (what it sends is ignored)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except (ssl.SSLError, OSError):
        return True
    return False


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _rejected(transport: PeerTransport) -> dict[str, int]:
    return transport.snapshot()["rejected"]


def _state(transport: PeerTransport) -> dict:
    """The transport's buffers and connections, read on its loop."""

    async def read():
        inbound = transport.inbound
        return {
            "buffered": {k: v for k, v in inbound.buffered.items() if v},
            "batches": len(inbound.batches),
            "inbound": {k: len(v) for k, v in inbound.gate.inbound.items()},
            "connections": inbound.gate.count,
        }

    return transport._thread.call(read(), timeout=10)


def _message(src: int, dst: int, floats: int) -> bytes:
    return encode(
        "x", 0, Messages(torch.tensor([src]), torch.tensor([dst]), {"w": torch.zeros(1, floats)})
    )


def _wire_seq(run_id: str, seq: int) -> int:
    return (zlib.crc32(run_id.encode()) & 0xFFFFFF) << EPOCH_SHIFT | seq


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _in_threads(*calls):
    """Run each (function, *args) in a thread; returns their results (60 s at most)."""
    results: list = [None] * len(calls)

    def run(i, function, *args):
        results[i] = function(*args)

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_a_flood_of_idle_sockets_does_not_lock_out_peers_or_the_launcher(tmp_path):
    limits = Limits(exchange_timeout_s=30, retries=3, backoff_s=0.1)
    with _cluster(tmp_path, ["a", "b"], limits) as (peers, nodes):
        for transport in nodes.values():
            transport.begin_run("flood")
        port = peers.by_id["a"].port
        flood: list[socket.socket] = []
        try:
            for _ in range(
                300
            ):  # plain TCP, never a byte: before, these took every connection slot for 10 s
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            evicted = "handshake evicted (per-source budget full)"
            assert _until(
                lambda: (
                    _rejected(nodes["a"]).get(evicted, 0) >= 300 - limits.max_handshakes_per_source
                )
            )
            started = time.monotonic()
            link = LauncherLink(peers, tmp_path, limits)
            try:
                link.connect_all(20)
                assert link.send("a", {"type": "hello"})
                assert nodes["a"].control.get(timeout=10)["type"] == "hello"
                frame = _message(1, 0, 4)
                got, sent = _in_threads(
                    (nodes["a"].exchange, 1, {}, MARKER, {"b"}, set()),
                    (nodes["b"].exchange, 1, {"a": [frame]}, MARKER, set(), {"a"}),
                )
            finally:
                link.close()
            assert (
                time.monotonic() - started < 45
            )  # a bound far above the work, not a speed figure (bench/device_flood.py)
            assert not got.absent and got.received["b"][0]["count"] == 1 and not sent.unreachable
            assert _rejected(nodes["a"]).get(evicted, 0) >= 300 - limits.max_handshakes_per_source
            assert _state(nodes["a"])["connections"] <= 2  # b, and the launcher until it closed
        finally:
            for sock in flood:
                sock.close()


def test_authenticated_connections_are_capped_per_identity_and_in_total(tmp_path):
    limits = Limits(max_connections_per_identity=3, max_connections=5)
    with _cluster(tmp_path, ["a", "b", "c"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        mine: list[ssl.SSLSocket] = []
        try:
            for i in range(5):
                mine.append(_tls(tmp_path, port, "b"))
                assert _until(
                    lambda i=i: (
                        _state(a)["inbound"].get("b") == min(i + 1, 3)
                        and _rejected(a).get("connections per identity", 0) == max(i - 2, 0)
                    )
                )
            assert _closed_by_peer(mine[0], 5) and _closed_by_peer(mine[1], 5)  # its oldest went
            assert not _closed_by_peer(mine[4], 0.3)
            assert _until(lambda: _state(a)["connections"] == 3)
            theirs = [_tls(tmp_path, port, "c") for _ in range(3)]
            mine += theirs
            assert _until(lambda: _rejected(a).get("connection limit", 0) == 1)
            assert _closed_by_peer(theirs[2], 5) and _state(a)["inbound"] == {"b": 3, "c": 2}
        finally:
            for sock in mine:
                sock.close()


def test_silent_and_trickling_connections_are_closed(tmp_path):
    limits = Limits(idle_timeout_s=1.0, min_rate_bytes_s=1024)
    with _cluster(tmp_path, ["a", "b"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("idle")
        silent = _tls(tmp_path, port, "b")
        started = time.monotonic()
        assert _closed_by_peer(silent, 10) and time.monotonic() - started >= 0.9
        silent.close()
        assert _rejected(a) == {"idle connection": 1}
        # a 200-byte marker at 5 bytes/s: cut after min(idle, 10 s) + 200 / 1024 s, not after 40 s
        trickle = _tls(tmp_path, port, "b")
        frame = pack(
            KIND_END, _wire_seq("idle", 1), dump_json({**MARKER, "count": 0, "pad": "x" * 150})
        )
        trickle.sendall(frame[:14])
        started, cut = time.monotonic(), False
        for byte in frame[14:]:
            try:
                trickle.sendall(bytes([byte]))
            except (ssl.SSLError, OSError):
                cut = True
                break
            if _closed_by_peer(trickle, 0.2):
                cut = True
                break
        trickle.close()
        # cut long before the 40 s the marker would take (a bound, not a speed figure: loaded machines are slow)
        assert (
            cut
            and time.monotonic() - started < 30
            and _rejected(a) == {"idle connection": 1, "slow frame": 1}
        )
        assert _until(lambda: _state(a)["connections"] == 0)


def test_the_pinged_launcher_and_peers_between_exchanges_outlive_the_idle_timeout(tmp_path):
    limits = Limits(idle_timeout_s=1.0, exchange_timeout_s=30)
    with _cluster(tmp_path, ["a", "b"], limits) as (peers, nodes):
        a = nodes["a"]
        for transport in nodes.values():
            transport.begin_run("idle")
        link = LauncherLink(peers, tmp_path, limits)  # it pings every idle_timeout_s / 3
        try:
            link.connect_all(20)
            time.sleep(3.0)
            assert link.send("a", {"type": "hello"})
            assert a.control.get(timeout=10) == {
                "v": "1",
                "type": "hello",
            }  # no launcher-closed before it
            assert link.events.empty()  # pongs are not events
        finally:
            link.close()
        # b's data connection idles out between exchanges while a waits for b: b is not taken for gone
        for seq, delay in ((1, 0.0), (2, 2.0)):

            def late_send(seq=seq, delay=delay):
                time.sleep(delay)  # b computes for longer than a's idle timeout
                return nodes["b"].exchange(seq, {"a": [_message(1, 0, 4)]}, MARKER, set(), {"a"})

            got, sent = _in_threads((a.exchange, seq, {}, MARKER, {"b"}, set()), (late_send,))
            assert not got.absent and len(got.received["b"][1]) == 1 and not sent.unreachable
        snapshot = a.snapshot()
        assert (
            snapshot["idle_closed"] >= 1 and "idle connection" not in snapshot["rejected"]
        )  # no rejection: a quiet close


def test_an_idle_peer_reads_and_buffers_nothing_of_what_is_pushed(tmp_path):
    with _cluster(tmp_path, ["a", "b"], Limits(), started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        small = pack(KIND_MESSAGE, 1, _message(1, 0, 12_000))  # ~48 KB: read, then rejected
        chunk = bytes(2**20)
        before = _rss_mb()
        for _ in range(4):  # 64 MiB frames: refused by their length field, never read
            sock = _tls(tmp_path, port, "b")
            try:
                sock.sendall(struct.pack("!IBBQ", 10 + 64 * 2**20, 1, KIND_MESSAGE, 1))
                for _ in range(64):
                    sock.sendall(chunk)
            except (ssl.SSLError, OSError):
                pass
            assert _closed_by_peer(sock, 10)
            sock.close()
        sock = _tls(tmp_path, port, "b")
        try:
            for _ in range(300):
                sock.sendall(small)
            sock.sendall(pack(KIND_END, 1, dump_json({**MARKER, "count": 300})))
            assert _until(lambda: _rejected(a).get("no run active", 0) == 301)
        finally:
            sock.close()
        rejected = _rejected(a)
        assert rejected["oversized frame"] == 4 and set(rejected) == {
            "oversized frame",
            "no run active",
        }
        state = _state(a)
        assert state["buffered"] == {} and state["batches"] == 0
        assert _rss_mb() - before < 50


def test_buffers_during_a_run_are_capped_per_sender_and_in_total(tmp_path):
    limits = Limits(buffer_floor_bytes=64 * 1024, buffer_model_factor=2)
    with _cluster(tmp_path, ["a", "b", "c", "d", "e"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("caps")
        assert a.buffer_caps() == (64 * 1024, 3 * 64 * 1024)  # the floor, before the model is known
        a.set_model_bytes(48 * 1024)
        per_sender, total = a.buffer_caps()
        assert (per_sender, total) == (96 * 1024, 3 * 96 * 1024)
        seq, size = _wire_seq("caps", 1), len(_message(1, 0, 2500))
        socks = []
        try:
            for count, sender in enumerate(["b", "c", "d", "e"], 1):
                node = peers.by_id[sender].node
                socks.append(_tls(tmp_path, port, sender))
                socks[-1].sendall(
                    b"".join(pack(KIND_MESSAGE, seq, _message(node, 0, 2500)) for _ in range(14))
                )

                def processed(count=count):
                    snapshot = a.snapshot()
                    return (
                        snapshot.get("frames_received", 0)
                        + snapshot["rejected"].get("buffer full", 0)
                        == 14 * count
                    )

                assert _until(processed)
            buffered = _state(a)["buffered"]
            assert (
                all(nbytes <= per_sender for nbytes in buffered.values())
                and buffered["b"] > per_sender - size
            )
            assert (
                total - size < sum(buffered.values()) <= total and buffered["e"] < buffered["b"]
            )  # the total cap held
            assert _rejected(a)["buffer full"] == 56 - sum(buffered.values()) // size
            # a frame beyond the per-sender cap is refused by its length, and the connection closed
            try:
                socks[0].sendall(pack(KIND_MESSAGE, seq, _message(1, 0, per_sender // 4 + 10)))
            except (
                OSError
            ):  # the peer read the length and closed while the body was still being sent
                pass
            else:
                assert _closed_by_peer(socks[0], 10)
            assert _until(lambda: _rejected(a).get("oversized frame") == 1)
            for sock in socks[1:]:
                sock.sendall(pack(KIND_END, seq, dump_json({**MARKER, "count": 14})))
            result = a.exchange(1, {}, MARKER, {"c", "d", "e"}, set())
            assert (
                not result.absent and sum(len(items) for _, items in result.received.values()) > 0
            )
            assert (
                _state(a)["buffered"] == {}
            )  # consumed, and b's unfinished batch dropped with its exchange
            socks[1].sendall(pack(KIND_MESSAGE, _wire_seq("caps", 2), _message(2, 0, 2500)))
            assert _until(lambda: _state(a)["buffered"] == {"c": size})
            a.end_run()
            assert _state(a)["buffered"] == {} and _state(a)["batches"] == 0
        finally:
            for sock in socks:
                sock.close()


class _Recorder:
    """A link shaper that only records what it paced."""

    def __init__(self) -> None:
        self.paced: list[int] = []

    async def pace(self, nbytes: int) -> None:
        self.paced.append(nbytes)


def test_a_peer_dropped_by_the_launcher_is_refused_and_not_waited_for(tmp_path):
    limits = Limits(exchange_timeout_s=30, retries=1, backoff_s=0.05)
    with _cluster(tmp_path, ["a", "b", "c"], limits) as (peers, nodes):
        for transport in nodes.values():
            transport.begin_run("drop")
        link = LauncherLink(peers, tmp_path, limits)
        try:
            link.connect_all(20)
            for peer in ("a", "b"):
                assert link.send(peer, {"type": "drop", "peer": "c"})
            assert _until(lambda: all(nodes[p].snapshot()["refused"] == ["c"] for p in "ab"))
        finally:
            link.close()
        assert (
            nodes["a"].control.get(timeout=5)["type"] == "launcher-closed"
        )  # the drop itself never reached the node
        with pytest.raises(ValueError):
            nodes["a"].refuse("nobody")
        frames = {p: [_message(2, peers.by_id[p].node, 4)] for p in "ab"}
        nodes["c"].exchange(
            1, frames, MARKER, set(), {"a", "b"}
        )  # c still sends: refused after its handshake
        assert _until(lambda: _rejected(nodes["a"]).get("dropped by the launcher", 0) >= 1)
        nodes["b"].shaper = recorder = _Recorder()
        started = time.monotonic()
        got_a, got_b = _in_threads(
            (
                nodes["a"].exchange,
                1,
                {"b": [_message(0, 1, 4)], "c": [_message(0, 2, 4)]},
                MARKER,
                {"b", "c"},
                {"b", "c"},
            ),
            (nodes["b"].exchange, 1, {"a": [_message(1, 0, 4)]}, MARKER, {"a", "c"}, {"a", "c"}),
        )
        assert (
            time.monotonic() - started < 25
        )  # below the 30 s exchange timeout: no peer waited it out
        assert got_a.absent == {"c"} and set(got_a.received) == {"b"} and got_a.unreachable == {"c"}
        assert got_b.absent == {"c"} and set(got_b.received) == {"a"}
        assert (
            sum(recorder.paced) == got_b.wire_bytes_sent > 0 and len(recorder.paced) == 2
        )  # message and marker
        assert _state(nodes["a"])["inbound"].get("c") is None


def test_counters_refusals_and_buffers_are_per_run(tmp_path):
    with _cluster(tmp_path, ["a", "b"], Limits(), started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        sock = _tls(tmp_path, port, "b")
        try:
            sock.sendall(pack(KIND_END, 1, dump_json({**MARKER, "count": 0})))
            assert _until(lambda: _rejected(a).get("no run active", 0) == 1)
            a.begin_run("r1")
            snapshot = a.snapshot()
            assert (
                snapshot["rejected"] == {}
                and snapshot["refused"] == []
                and "frames_received" not in snapshot
            )
            assert snapshot["rejected_before_run"] == {"no run active": 1}
            sock.sendall(pack(KIND_MESSAGE, _wire_seq("r1", 1), _message(1, 0, 100)))
            sock.sendall(pack(KIND_MESSAGE, _wire_seq("other", 1), _message(1, 0, 100)))
            assert _until(lambda: a.snapshot().get("frames_received", 0) == 2)
            assert _state(a)["buffered"] == {"b": len(_message(1, 0, 100))} and _rejected(a) == {
                "another run": 1
            }
            a.end_run()
            assert _state(a)["buffered"] == {} and _state(a)["batches"] == 0
            sock.sendall(pack(KIND_MESSAGE, _wire_seq("r1", 2), _message(1, 0, 100)))
            assert _until(lambda: _rejected(a) == {"another run": 1, "no run active": 1})
            a.refuse("b")
            assert _closed_by_peer(sock, 10) and a.snapshot()["refused"] == ["b"]
        finally:
            sock.close()
        a.begin_run("r2")
        snapshot = a.snapshot()
        assert snapshot["rejected"] == {} and snapshot["refused"] == []
        assert snapshot["rejected_before_run"] == {
            "no run active": 1
        }  # r1's own counts were its own
        with _tls(tmp_path, port, "b") as sock:  # b is welcome again
            sock.sendall(pack(KIND_MESSAGE, _wire_seq("r2", 1), _message(1, 0, 100)))
            assert _until(lambda: _state(a)["buffered"].get("b", 0) > 0)


def test_the_handshake_budget_evicts_the_oldest_of_a_source_then_overall():
    budget, evicted = HandshakeBudget(), []
    for key, source in enumerate(["x", "x", "y", "x"]):  # at most 2 per source, 3 in all
        for reason, victim in budget.admit(key, source, lambda key=key: evicted.append(key), 2, 3):
            assert (reason, victim) == ("handshake evicted (per-source budget full)", "x")
    assert evicted == [0] and len(budget) == 3
    budget.release(1)  # handshake 1 finished
    budget.admit(4, "z", lambda: evicted.append(4), 2, 3)
    assert budget.admit(5, "w", lambda: evicted.append(5), 2, 3) == [
        ("handshake evicted (handshake budget full)", "y")
    ]
    assert evicted == [0, 2] and len(budget) == 3  # 2 (from y) was the oldest left


def test_the_handshake_budget_never_evicts_a_handshake_under_way_for_a_silent_newcomer():
    budget, evicted, busy = HandshakeBudget(), [], {"b": False}

    def admit(key, now=0.0):
        return budget.admit(
            key,
            "x",
            lambda: evicted.append(key),
            3,
            10,
            busy=lambda: busy.get(key, False),
            now=now,
            stalled_s=1.0,
        )

    for key in ("a", "b", "c"):
        admit(key)
    budget.advance("a", 0.0)  # a and b sent their ClientHello; c is silent
    budget.advance("b", 0.0)
    assert admit("d") == [("handshake evicted (per-source budget full)", "x")] and evicted == [
        "c"
    ]  # the silent one
    assert admit("e", now=0.5) == [
        ("handshake evicted (per-source budget full)", "x")
    ] and evicted == ["c", "d"]
    budget.advance("e", 0.5)
    # only handshakes under way now: none stalled yet, so the newcomer is refused, nothing evicted
    assert (
        admit("f", now=0.9) == [("handshake refused (every pending one under way)", "x")]
        and "f" not in budget
    )
    # stalled for 1 s: the oldest goes, unless its client is sending right now (a TLS 1.3 client that sent its last
    # flight counts the handshake complete)
    busy["a"] = True
    assert admit("g", now=1.2) == [
        ("handshake evicted (per-source budget full)", "x")
    ] and evicted == ["c", "d", "b"]
    budget.release("a")  # done: released the moment the TLS layer completes, so never evicted
    assert "a" not in budget and len(budget) == 2


def test_a_flood_of_silent_sockets_never_costs_a_fresh_launcher_connection(tmp_path):
    limits = Limits(max_handshakes_per_source=4, max_handshakes=8)
    with _cluster(tmp_path, ["a"], limits) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        stop, opened = threading.Event(), [0]

        def flood() -> (
            None
        ):  # 300 plain TCP sockets held, those the peer closes reopened (30 s at most)
            held: list[socket.socket] = []
            deadline = time.monotonic() + 30
            try:
                while not stop.is_set() and time.monotonic() < deadline:
                    held = [s for s in held if not _closed_by_peer(s, 0)]
                    while len(held) < 300:
                        try:
                            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                            opened[0] += 1
                        except OSError:
                            break
                    stop.wait(0.05)
            finally:
                for sock in held:
                    sock.close()

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        usable = 0
        try:
            assert _until(lambda: opened[0] >= 300)
            for number in range(
                40
            ):  # each fresh connection: handshake, a control message, then closed
                sock = _tls(tmp_path, port, "launcher")
                try:
                    sock.sendall(pack(ord("C"), 0, dump_json({"type": "hello", "n": number})))
                    for _ in range(3):  # the previous connection's launcher-closed may come first
                        message = a.control.get(timeout=10)
                        if message["type"] == "hello":
                            usable += message["n"] == number
                            break
                finally:
                    sock.close()
        finally:
            stop.set()
            thread.join(40)
        rejected = _rejected(a)
        assert usable == 40, (usable, rejected)
        assert rejected.get("handshake evicted (per-source budget full)", 0) > 0, (
            rejected
        )  # the flood was there


def test_the_launcher_reconnects_during_start_up_and_not_after(tmp_path):
    with _cluster(tmp_path, ["a"], Limits()) as (peers, nodes):
        a = nodes["a"]
        link = LauncherLink(peers, tmp_path, Limits())
        try:
            link.reconnect_within(30)
            link.connect_all(20)
            assert _until(lambda: a.inbound.launcher is not None)

            async def cut() -> (
                None
            ):  # as a flood's eviction did: the peer ends a connection the launcher holds
                a.inbound.launcher.abort()

            a._thread.call(cut(), timeout=10)
            assert link.events.get(timeout=20) == ("a", EVENT_RECONNECTED, b"")
            assert link.reconnects["a"] == 1 and link.send("a", {"type": "hello"})
            assert _until(lambda: not a.control.empty()) and a.control.get(timeout=5)["type"] in (
                "launcher-closed",
                "hello",
            )
            link.reconnect_within(None)  # the run started: a closed connection is the peer's drop
            assert _until(lambda: a.inbound.launcher is not None)
            a._thread.call(cut(), timeout=10)
            assert link.events.get(timeout=20) == ("a", None, b"")
        finally:
            link.close()


def test_round_reports_queued_without_waiting_reach_the_launcher_in_order(tmp_path):
    with _cluster(tmp_path, ["a"], Limits()) as (peers, nodes):
        a = nodes["a"]
        link = LauncherLink(peers, tmp_path, Limits())
        try:
            link.connect_all(20)
            assert _until(lambda: a.inbound.launcher is not None)
            for index in range(30):  # a round's report: queued, the next round goes on at once
                a.report_later({"type": "round", "round": index})
            assert a.report({"type": "final"})  # a waited-for report leaves after every queued one
            got = []
            while len(got) < 31:
                peer, kind, body = link.events.get(timeout=10)
                if kind is not None:
                    got.append(load_json(body))
            assert [m.get("round") for m in got] == [*range(30), None] and got[-1][
                "type"
            ] == "final"
        finally:
            link.close()


def _exchange_in_thread(transport: PeerTransport, seq: int, expected: set[str]):
    """`transport`'s exchange `seq` (nothing sent) run in a thread; its result, or None
    when it has not returned within 60 s (the exchange timeout in these tests is 600 s)."""
    results: list = []
    thread = threading.Thread(
        target=lambda: results.append(transport.exchange(seq, {}, MARKER, expected, set()))
    )
    thread.start()
    thread.join(60)
    return results[0] if results else None


def test_a_peer_withholding_its_end_markers_is_dropped_after_k_exchanges_and_no_longer_waited_for(
    tmp_path,
):
    limits = Limits(exchange_timeout_s=1.0, slow_peer_exchanges=2)
    with _cluster(tmp_path, ["a", "b", "c"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("slow")
        b, c = _tls(tmp_path, port, "b"), _tls(tmp_path, port, "c")
        try:
            for seq in (1, 2):  # b sends its message, never its end marker; c is on time
                b.sendall(pack(KIND_MESSAGE, _wire_seq("slow", seq), _message(1, 0, 4)))
                c.sendall(pack(KIND_END, _wire_seq("slow", seq), dump_json({**MARKER, "count": 0})))
                result = a.exchange(seq, {}, MARKER, {"b", "c"}, set())
                assert result.absent == {"b"} and set(result.received) == {"c"}
                assert [e["peer"] for e in result.dropped] == (["b"] if seq == 2 else [])
            snapshot = a.snapshot()
            assert [e["peer"] for e in snapshot["slow_dropped"]] == ["b"] and snapshot[
                "refused"
            ] == ["b"]
            assert (
                "no end marker" in snapshot["slow_dropped"][0]["reason"]
                and snapshot["slow_dropped"][0]["seq"] == 2
            )
            assert _closed_by_peer(b, 10)  # its connection closed, and it is refused from now on
            with _tls(tmp_path, port, "b") as again:
                assert _closed_by_peer(again, 10)
            assert _until(lambda: _rejected(a).get("dropped as a slow peer", 0) >= 1)
            c.sendall(pack(KIND_END, _wire_seq("slow", 3), dump_json({**MARKER, "count": 0})))
            result = a.exchange(3, {}, MARKER, {"b", "c"}, set())
            assert result.absent == {"b"} and set(result.received) == {"c"} and result.dropped == []
        finally:
            b.close()
            c.close()


def test_slow_in_two_of_the_last_k_exchanges_is_dropped_and_a_slow_batch_counts_as_slow(tmp_path):
    limits = Limits(
        exchange_timeout_s=600,
        slow_peer_exchanges=2,
        slow_peer_grace_s=0.2,
        slow_peer_rate_bytes_s=1 << 20,
    )
    with _cluster(tmp_path, ["a", "b"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("rate")
        b = _tls(tmp_path, port, "b")
        try:
            # slow on every other exchange: 2 of the last K = 6, dropped at the second (an exchange on time no
            # longer resets a count, which let such a peer stretch every other exchange)
            for seq, slow in ((1, True), (2, False), (3, True)):
                frame = pack(KIND_END, _wire_seq("rate", seq), dump_json({**MARKER, "count": 0}))
                if slow:  # the header at once, the body 1 s later: far below 1 MiB/s after the 0.2 s grace
                    b.sendall(frame[:14])
                    time.sleep(1.0)
                b.sendall(frame[14:] if slow else frame)
                result = _exchange_in_thread(a, seq, {"b"})
                assert result is not None and set(result.received) == {
                    "b"
                }  # slow, but it arrived: used
                assert [e["peer"] for e in result.dropped] == (["b"] if seq == 3 else []), seq
            assert "below 1048576 B/s" in a.snapshot()["slow_dropped"][0]["reason"]
        finally:
            b.close()


def test_a_peer_cut_for_a_slow_frame_is_not_waited_for(tmp_path):
    limits = Limits(
        exchange_timeout_s=600, idle_timeout_s=1.0, min_rate_bytes_s=1024, slow_peer_exchanges=1
    )
    with _cluster(tmp_path, ["a", "b"], limits, started={"a"}) as (peers, nodes):
        a, port = nodes["a"], peers.by_id["a"].port
        a.begin_run("cut")
        b = _tls(tmp_path, port, "b")
        try:
            frame = pack(
                KIND_END, _wire_seq("cut", 1), dump_json({**MARKER, "count": 0, "pad": "x" * 4000})
            )
            b.sendall(
                frame[:200]
            )  # the rest never comes: cut after min(idle, 10 s) + 4 KB / 1 KiB/s
            result = _exchange_in_thread(a, 1, {"b"})
            assert result is not None and result.absent == {
                "b"
            }  # not waited for the 600 s exchange timeout
            assert [e["peer"] for e in result.dropped] == ["b"] and "slow frame" in result.dropped[
                0
            ]["reason"]
            assert _rejected(a)["slow frame"] == 1
        finally:
            b.close()
