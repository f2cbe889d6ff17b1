"""Peer reports are typed and checked once, on arrival (`report_schema`): an honest report
reads as typed attributes; a field missing, of the wrong type or not finite, a peer id or
client that is not the sender's, a block the schedule lacks, or a peer the peers file lacks
is rejected with one reason naming the peer; the launcher counts, keeps and charges it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from p4bench_device.admission import RejectLog
from p4bench_device.launcher import Launcher
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.protocol import KIND_REPORT, Limits, dump_json
from p4bench_device.report_schema import (
    BlockReport,
    Failure,
    FinalReport,
    MalformedRelease,
    Ready,
    ReleaseClaim,
    ReportContext,
    ReportError,
    parse_report,
)

PEERS = PeersFile(
    (
        PeerSpec("a", "127.0.0.1", 1, 0),
        PeerSpec("b", "127.0.0.1", 2, 1),
        PeerSpec("hub", "127.0.0.1", 3, -1),
    )
)
CONTEXT = ReportContext(
    PEERS, frozenset({("setup", "train", -1), ("round", "train", 0), ("round", "train", 1)})
)


def _round(**changes):
    """A round report of peer a as `DeviceNode._report` writes it (with the transport's ``peer``)."""
    report = {
        "type": "round",
        "peer": "a",
        "node": 0,
        "phase": "train",
        "round": 1,
        "accuracy": 0.5,
        "extra": {"acc_b": 0.25},
        "losses": [0.7, float("nan")],
        "bytes_sent": 120,
        "node_bytes_sent": 120,
        "node_bytes_received": 80,
        "measure": {
            "wall_s": 1.5,
            "compute_s": 1.0,
            "comm_s": 0.5,
            "cpu_s": 1.2,
            "peak_rss_mb": 300.0,
            "exchanges": {"mix": {"wall_s": 0.5, "compute_s": 0.1, "count": 1, "messages_sent": 2}},
            "between_rounds_s": 0.1,
            "compute_segments": [0.6, 0.4],
            "wire_bytes_sent": 150,
            "wire_bytes_received": 100,
            "eval_s": 0.05,
        },
        "releases": [
            {
                "clients": [0],
                "sample_rate": 0.2,
                "noise_multiplier": 0.8,
                "steps": 2,
                "phase": "train",
                "clip": 1.0,
            }
        ],
        "absent": [{"exchange": "mix", "peers": ["b"]}],
        "slow_dropped": [
            {
                "peer": "b",
                "seq": 7,
                "phase": "train",
                "round": 1,
                "exchange": "mix",
                "reason": "no end marker",
            }
        ],
        "receive_errors": 0,
        "metrics": {"votes": 3.0, "ratio": float("inf")},
    }
    for key, value in changes.items():
        if value is _DROP:
            del report[key]
        else:
            report[key] = value
    return report


_DROP = object()


def _parse(report, sender="a"):
    return parse_report(dump_json(report), sender, CONTEXT)


def _rejected(report, sender="a", body=None) -> str:
    with pytest.raises(ReportError) as info:
        parse_report(body if body is not None else dump_json(report), sender, CONTEXT)
    assert info.value.peer == sender
    assert str(info.value).startswith(f"report from peer {sender} rejected: ")
    return info.value.what


def test_an_honest_round_report_reads_as_typed_attributes():
    report = _parse(_round())
    assert isinstance(report, BlockReport)
    assert (report.kind, report.peer, report.node, report.phase, report.round) == (
        "round",
        "a",
        0,
        "train",
        1,
    )
    assert report.accuracy == 0.5 and report.extra == {"acc_b": 0.25}
    assert report.losses == (
        0.7,
        None,
    )  # a diverged loss: null on the wire, None here, never a number
    assert report.metrics == {"votes": 3.0, "ratio": None}
    assert report.measure.wall_s == 1.5 and report.measure.compute_segments == (0.6, 0.4)
    assert report.measure.exchanges == {
        "mix": {"wall_s": 0.5, "compute_s": 0.1, "count": 1.0, "messages_sent": 2.0}
    }
    assert report.measure.power_w is None and report.measure.wire_bytes_sent == 150
    assert report.releases == (ReleaseClaim((0,), 0.2, 0.8, 2, "train", 1.0),)
    assert [(a.exchange, a.peers) for a in report.absent] == [("mix", ("b",))]
    assert [(d.peer, d.seq, d.reason) for d in report.slow_dropped] == [("b", 7, "no end marker")]


def test_ready_error_setup_and_final_reports_of_the_server_and_a_client():
    assert _parse({"type": "ready", "peer": "hub", "node": -1}, "hub") == Ready("hub", -1)
    assert _parse({"type": "error", "peer": "b", "node": 1, "message": "x" * 3000}, "b") == Failure(
        "b", 1, "x" * 2000
    )
    setup = _parse(_round(type="setup", round=-1, accuracy=None, extra={}))
    assert isinstance(setup, BlockReport) and setup.kind == "setup" and setup.accuracy is None
    final = _parse(
        {
            "type": "final",
            "peer": "a",
            "node": 0,
            "accuracy": None,
            "extra": {},
            "receive_errors": 2,
            "transport": {"rejected": {}},
            "stopped_after_step": 2,
            "finish_after": None,
            "profile": None,
            "link": {"bytes_paced": 10},
        }
    )
    assert final == FinalReport(
        "a", 0, None, {}, 2, 2, None, {"rejected": {}}, None, {"bytes_paced": 10}
    )


@pytest.mark.parametrize(
    "changes, what",
    [
        ({"accuracy": _DROP}, "round report: 'accuracy' is missing"),
        ({"round": "1"}, "round report: 'round' is not an integer"),
        ({"round": True}, "round report: 'round' is not an integer"),
        ({"bytes_sent": -5}, "round report: 'bytes_sent' is -5, below 0"),
        ({"losses": [0.1, "0.2"]}, "round report: 'losses' entry 1 is not a number"),
        ({"extra": [0.5]}, "round report: 'extra' is not an object"),
        ({"measure": {"wall_s": 1.0}}, "round report: 'measure': 'compute_s' is missing"),
        ({"releases": {"clients": [0]}}, "round report: 'releases' is not a list"),
        ({"phase": "other"}, "round report: round 1 of phase 'other' is not in the schedule"),
        ({"round": 5}, "round report: round 5 of phase 'train' is not in the schedule"),
        ({"type": "setup"}, "setup report: setup 1 of phase 'train' is not in the schedule"),
        (
            {"type": "pong"},
            "pong report: 'type' is 'pong', not ready, error, round, setup or final",
        ),
        ({"peer": "b"}, "round report: 'peer' is 'b', not the sender"),
        ({"peer": _DROP}, "round report: 'peer' is missing"),
        ({"node": 1}, "round report: 'node' is 1, but peer a holds client 0"),
        (
            {"absent": [{"exchange": "mix", "peers": ["a", "zed"]}]},
            "round report: 'absent' entry 0: 'peers' names a, zed: not another peer of the peers file",
        ),
        (
            {
                "slow_dropped": [
                    {
                        "peer": "a",
                        "seq": 1,
                        "phase": "train",
                        "round": 1,
                        "exchange": "mix",
                        "reason": "",
                    }
                ]
            },
            "round report: 'slow_dropped' entry 0: 'peer' is 'a': not another peer of the peers file",
        ),
    ],
)
def test_a_malformed_report_is_rejected_with_one_reason_naming_the_peer(changes, what):
    assert _rejected(_round(**changes)) == what


def test_a_number_that_is_not_finite_and_a_body_that_is_not_a_report_are_rejected():
    body = dump_json(
        _round()
    )  # a peer's dump_json writes a non-finite number as null; a raw 1e999 is infinite
    assert (
        _rejected(None, body=body.replace(b'"accuracy":0.5', b'"accuracy":1e999'))
        == "round report: 'accuracy' is not finite"
    )
    assert (
        _rejected(None, body=body.replace(b'"wall_s":1.5', b'"wall_s":-1e999'))
        == "round report: 'measure': 'wall_s' is not finite"
    )
    assert _rejected(None, body=body.replace(b'"accuracy":0.5', b'"accuracy":NaN')).startswith(
        "malformed JSON"
    )
    assert _rejected(None, body=b"[1, 2]").startswith("malformed JSON")
    assert _rejected(None, body=b'{"type": "ready", "peer": "a", "node": 0}').startswith(
        "protocol version"
    )
    assert (
        _rejected({"type": "ready", "peer": "hub", "node": 0}, "hub")
        == "ready report: 'node' is 0, but peer hub holds no client (the server)"
    )


def test_a_malformed_release_entry_is_kept_for_the_release_check_not_a_reason_to_reject():
    report = _parse(
        _round(
            releases=[
                {"clients": "x"},
                {
                    "clients": [],
                    "sample_rate": 0.2,
                    "noise_multiplier": 0.8,
                    "steps": 1,
                    "phase": "train",
                    "clip": None,
                },
                3,
            ]
        )
    )
    assert isinstance(report, BlockReport)
    assert report.releases == (
        MalformedRelease("release: 'clients' is not a list"),
        MalformedRelease("no clients"),
        MalformedRelease("not an object"),
    )


def test_the_launcher_counts_keeps_and_charges_a_rejected_report_and_reads_the_valid_ones():
    launcher = Launcher(PEERS, "unused", Limits())
    found: list[tuple[str, str]] = []
    launcher.context, launcher.figures = (
        CONTEXT,
        SimpleNamespace(rejected=lambda peer, what: found.append((peer, what))),
    )
    events = [
        ("b", KIND_REPORT, dump_json(_round(node=1))),
        ("a", KIND_REPORT, dump_json(_round(metrics={"x": "1"}))),
        ("a", KIND_REPORT, dump_json(_round())),
        ("hub", KIND_REPORT, dump_json({"type": "ready", "peer": "hub", "node": -1})),
    ]
    launcher.link = SimpleNamespace(
        events=SimpleNamespace(get=lambda timeout: events.pop(0)), rejects=RejectLog()
    )
    while events:
        assert launcher._pump(0.0)
    assert launcher.rejected_reports == [
        {"peer": "b", "reason": "round report: 'peer' is 'a', not the sender"},
        {"peer": "a", "reason": "round report: 'metrics': 'x' is not a number"},
    ]
    assert found == [
        (r["peer"], r["reason"]) for r in launcher.rejected_reports
    ]  # the release check's mismatches
    assert launcher.link.rejects.snapshot() == {"malformed report": 2}
    assert set(launcher.reports[("round", "train", 1)]) == {"a"} and launcher.ready == {"hub"}
    assert math.isclose(launcher.reports[("round", "train", 1)]["a"].measure.cpu_s, 1.2)
