"""The help text of each `protocol.Limits` field that is a run option (``device_<field>``);
a field without an entry here is no option of its own (buffer_budget_bytes: the run's
--memory-budget sets it)."""

from __future__ import annotations

__all__ = ["LIMIT_HELP"]

LIMIT_HELP: dict[str, str] = {
    "max_message_bytes": "largest frame body accepted, in bytes",
    "exchange_timeout_s": "wait for every live peer's end-of-exchange marker",
    "send_timeout_s": "send one batch of frames to one peer",
    "connect_timeout_s": "TCP connect plus TLS handshake",
    "retries": "extra attempts per send, with exponential backoff",
    "backoff_s": "first backoff; doubles per attempt",
    "round_timeout_s": "launcher: wait for a round report from a connected peer",
    "startup_timeout_s": "launcher: peers reachable and ready (imports, data)",
    "max_ahead": "exchanges a sender may run ahead of a peer",
    "max_connections": "simultaneous authenticated inbound connections of a peer",
    "max_connections_per_identity": (
        "authenticated inbound connections of one peer or the launcher (its oldest closed beyond)"
    ),
    "max_handshakes": "inbound connections still in their TLS handshake (the oldest is evicted beyond)",
    "max_handshakes_per_source": "inbound TLS handshakes from one source address (its oldest is evicted beyond)",
    "handshake_timeout_s": "inbound TLS handshake",
    "idle_timeout_s": "close an inbound connection that delivers no frame for this long (the launcher pings)",
    "min_rate_bytes_s": "slowest accepted frame body, in bytes per second, after a grace of min(idle timeout, 10 s)",
    "buffer_model_factor": (
        "per-sender buffer during a run, in model sizes (all senders: 3x, or 1/4 per peer beyond 12)"
    ),
    "buffer_floor_bytes": "per-sender buffer during a run at least, in bytes",
    "slow_peer_exchanges": "drop a peer slow or late in this many of the last slow_peer_window exchanges in which it "
    "was expected: not complete by its deadline (late_peer_grace_s, late_peer_factor), its connection cut for "
    "misbehaving, extra messages, or its batch below slow_peer_rate_bytes_s; each receiving peer drops it on its "
    "own and the run names it",
    "slow_peer_window": "the exchanges slow_peer_exchanges counts in: the last this many in which the peer was "
    "expected",
    "late_peer_grace_s": "a sender's deadline from the start of the exchange (as the receiver sees it) is at least "
    "this plus its bytes at slow_peer_rate_bytes_s; the receiver stops waiting for it there",
    "late_peer_factor": "a sender's deadline is also at least this many times the exchange's median completion "
    "time (the upper median sender's, once a majority is complete): honest compute skew, which a minority "
    "cannot move",
}
