"""The launcher's side of slow-peer drops (`liveness`): what the peers' round reports say
they dropped, and what of it the run publishes as fact.

A drop is only a peer's word: a compromised peer could list every honest peer as "dropped
slow" in its reports. So the launcher publishes a drop of peer X as fact (the summary's
``device.slow_dropped``, the round metrics ``device.slow_peers_dropped`` and
``device.<X>.slow_dropped_by``) only once a strict majority of the other peers (those still
in the run, and any that reported X) report dropping X: every receiver judges every sender
on its own, so a sender that is really slow or late is dropped by all its honest receivers.
The server peer of a server-based method is believed alone (`trusted`): clients' messages
go to it only, so only it sees their extra copies, and the method trusts it with the model
anyway (a compromised server needs no fake drops to do harm).
Reports that no majority backs are kept apart, worded as claims: ``device.slow_drops_unconfirmed``
("peer 1 reports it dropped slow peer 0 (unconfirmed: 1 of 4 other peers)") and the round
metrics ``device.slow_drops_unconfirmed`` (how many peers are named only so) and
``device.<X>.slow_drop_reports_unconfirmed`` (by how many reporters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p4bench_device.report_schema import SlowDrop

__all__ = ["announced", "confirmed_drops", "drop_metrics", "split_drops"]


def announced(
    reporter: str, drops: Sequence[SlowDrop], nodes: dict[str, int]
) -> list[dict[str, Any]]:
    """The slow-peer drops of `reporter`'s round report (checked on arrival: other peers of
    the peers file, `nodes`: id -> node), worded for the run's record: {"peer", "node",
    "by", "phase", "round", "exchange", "reason", "message"} each."""
    entries = []
    for drop in drops:
        message = (
            f"dropped slow peer {drop.peer} (by peer {reporter} in {drop.phase} round {drop.round}, "
            f"exchange {drop.exchange}: {drop.reason})"
        )
        entries.append(
            {
                "peer": drop.peer,
                "node": nodes[drop.peer],
                "by": reporter,
                "phase": drop.phase,
                "round": drop.round,
                "exchange": drop.exchange,
                "reason": drop.reason,
                "message": message,
            }
        )
    return entries


def _reporters(entries: Sequence[dict[str, Any]]) -> dict[str, set[str]]:
    by: dict[str, set[str]] = {}
    for entry in entries:
        by.setdefault(entry["peer"], set()).add(entry["by"])
    return by


def confirmed_drops(
    entries: Sequence[dict[str, Any]], active: set[str], trusted: frozenset[str] = frozenset()
) -> dict[str, tuple[int, int, bool]]:
    """Every peer named in `entries` -> (how many other peers report dropping it, how many
    other peers could: those `active` and those that reported it, confirmed: by more than
    half of them, or by a `trusted` peer)."""
    counts: dict[str, tuple[int, int, bool]] = {}
    for peer, reporters in _reporters(entries).items():
        backed, others = len(reporters - {peer}), len((active | reporters) - {peer})
        counts[peer] = (backed, others, 2 * backed > others or bool(reporters & trusted - {peer}))
    return counts


def split_drops(
    entries: Sequence[dict[str, Any]], active: set[str], trusted: frozenset[str] = frozenset()
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(confirmed, unconfirmed) copies of `entries` (`announced`): the reports of a drop a
    strict majority of the other peers (or a `trusted` one) backs, and the others, reworded
    as claims."""
    counts = confirmed_drops(entries, active, trusted)
    confirmed, unconfirmed = [], []
    for entry in entries:
        backed, others, sure = counts[entry["peer"]]
        if sure:
            confirmed.append(dict(entry, confirmed_by=backed, of=others))
            continue
        claim = entry["message"].replace(
            f"dropped slow peer {entry['peer']} (by peer {entry['by']} ",
            f"peer {entry['by']} reports it dropped slow peer {entry['peer']} (",
        )
        unconfirmed.append(
            dict(
                entry,
                message=f"{claim} (unconfirmed: {backed} of {others} other peers)",
                confirmed_by=backed,
                of=others,
            )
        )
    return confirmed, unconfirmed


def drop_metrics(
    entries: Sequence[dict[str, Any]], unconfirmed: Sequence[dict[str, Any]] = ()
) -> dict[str, float]:
    """Round metrics of the drops so far: how many peers were dropped as slow, and by how
    many peers each (``device.<peer>.slow_dropped_by``), from the `entries` of confirmed
    drops (`split_drops`); with the `unconfirmed` ones counted apart."""
    by, claimed = _reporters(entries), _reporters(unconfirmed)
    metrics = {
        "device.slow_peers_dropped": float(len(by)),
        **{
            f"device.{peer}.slow_dropped_by": float(len(receivers))
            for peer, receivers in sorted(by.items())
        },
    }
    if claimed:
        metrics["device.slow_drops_unconfirmed"] = float(len(claimed))
        for peer, reporters in sorted(claimed.items()):
            metrics[f"device.{peer}.slow_drop_reports_unconfirmed"] = float(len(reporters))
    return metrics
