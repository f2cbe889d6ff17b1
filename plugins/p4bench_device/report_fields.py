"""Figures the launcher derives from what peers report (typed on arrival, `report_schema`):
a peer's phase totals and round metrics, the round's critical compute path, the time
budget's stop beside where the peers stopped, and the deployed parameters of the states
peers send back at the end."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from p4bench.engine.method import Method
from p4bench.engine.state import State, cat_rows
from p4bench.models import Params
from p4bench_device.report_schema import BlockReport, Measure

__all__ = [
    "add_measure",
    "critical_compute_s",
    "deployed_from_states",
    "finish_summary",
    "peer_round_metrics",
    "round_metrics",
]

log = logging.getLogger("p4bench.device")


def critical_compute_s(measures: Sequence[Measure]) -> float | None:
    """The round's period (previous round's end to this one's) were communication free:
    every exchange waits for all peers' end markers, so each compute segment between two
    exchanges lasts as long as its slowest peer's; the first segment starts with the work
    between rounds (evaluation, report). None unless every peer reported the same number of
    segments (at least one)."""
    if not measures or not all(m.compute_segments for m in measures):
        return None
    peers = [
        [m.between_rounds_s + m.compute_segments[0], *m.compute_segments[1:]] for m in measures
    ]
    if len({len(s) for s in peers}) != 1:
        return None
    return float(sum(max(column) for column in zip(*peers)))


def deployed_from_states(
    method: Method, states: dict[int, State], count: int
) -> tuple[Params, State | None]:
    """(every client's deployed parameters, NaN for a peer that sent no usable state;
    the stacked state of all clients when every peer sent one and they stack)."""
    template = method.initial_params()
    params = {
        k: torch.full((count, *v.shape), float("nan"), dtype=v.dtype) for k, v in template.items()
    }
    for node, state in states.items():
        try:
            for key, value in method.deployed_params(state).items():
                params[key][node] = value[0]
        except Exception as exc:  # noqa: BLE001 - one peer's bad state loses that peer's parameters only
            log.warning("state of node %d does not hold deployable parameters: %r", node, exc)
    final_state = None
    if len(states) == count:
        try:
            final_state = cat_rows([states[i] for i in range(count)])
        except Exception as exc:  # noqa: BLE001
            log.warning("peer states cannot be stacked: %r", exc)
    return params, final_state


def finish_summary(finish: dict[str, Any], stopped_after: Mapping[str, int]) -> dict[str, Any]:
    """The time budget's stop (`finish`: the step the launcher told every peer to stop
    after) beside the step each peer says it stopped after (`stopped_after`, peer -> step),
    and whether they all agree."""
    stopped = {peer: stopped_after[peer] for peer in sorted(stopped_after)}
    consistent = set(stopped.values()) == {finish["after_step"]}
    if not consistent:
        log.warning(
            "time budget: the peers stopped after steps %s, not all after %d",
            stopped,
            finish["after_step"],
        )
    return {**finish, "stopped_after_step": stopped, "consistent": consistent}


def add_measure(totals: dict[str, Any], measure: Measure) -> None:
    """Add one report's measurements to a peer's phase totals (times, bytes, peak memory,
    energy where a power meter reported watts, and per-exchange figures)."""
    sums = {
        "wall_s": measure.wall_s,
        "compute_s": measure.compute_s,
        "comm_s": measure.comm_s,
        "eval_s": measure.eval_s,
        "cpu_s": measure.cpu_s,
        "wire_bytes_sent": measure.wire_bytes_sent,
        "wire_bytes_received": measure.wire_bytes_received,
    }
    for key, value in sums.items():
        totals[key] = totals.get(key, 0) + float(value)
    totals["peak_rss_mb"] = max(totals.get("peak_rss_mb", 0.0), measure.peak_rss_mb)
    if measure.power_w is not None:
        totals["energy_j"] = totals.get("energy_j", 0.0) + measure.power_w * measure.wall_s
        totals["metered_s"] = totals.get("metered_s", 0.0) + measure.wall_s
        totals["power_w"] = totals["energy_j"] / max(
            totals["metered_s"], 1e-12
        )  # time-weighted mean
    for name, figures in measure.exchanges.items():
        entry = totals["exchanges"].setdefault(name, {})
        for key, value in figures.items():
            entry[key] = entry.get(key, 0) + value


def peer_round_metrics(peer: str, measure: Measure) -> dict[str, float]:
    """A peer's round measurements as `device.<peer>.*` metrics, with each exchange's
    transfer time next to the link's capacity."""
    metrics: dict[str, float] = {}
    figures: dict[str, float | None] = {
        "wall_s": measure.wall_s,
        "compute_s": measure.compute_s,
        "comm_s": measure.comm_s,
        "cpu_s": measure.cpu_s,
        "between_rounds_s": measure.between_rounds_s,
        "peak_rss_mb": measure.peak_rss_mb,
        "wire_bytes_sent": measure.wire_bytes_sent,
        "wire_bytes_received": measure.wire_bytes_received,
        "power_w": measure.power_w,
    }
    for key, value in figures.items():
        if value is not None:
            metrics[f"device.{peer}.{key}"] = float(value)
    for name, exchange in measure.exchanges.items():
        prefix = f"device.{peer}.exchange.{name}"
        metrics[f"{prefix}.comm_s"] = max(
            exchange.get("wall_s", 0.0) - exchange.get("compute_s", 0.0), 0.0
        )
        metrics[f"{prefix}.wire_bytes_sent"] = exchange.get("wire_bytes_sent", 0.0)
        metrics[f"{prefix}.messages_sent"] = exchange.get("messages_sent", 0.0)
    return metrics


def round_metrics(reports: Mapping[str, BlockReport]) -> dict[str, float]:
    """A round's metrics from its reports (peer -> report): the method's counters summed
    over peers (ratios: `Method.derived_metrics`), every peer's measurements, the slowest
    peer's wall and compute time, the critical compute path and the absences."""
    metrics: dict[str, float] = {}
    for peer, report in reports.items():
        for key, value in report.metrics.items():
            if value is not None and not key.startswith("device."):
                metrics[key] = metrics.get(key, 0.0) + value
        metrics.update(peer_round_metrics(peer, report.measure))
    walls = [metrics[k] for k in metrics if k.endswith(".wall_s")]
    computes = [metrics[k] for k in metrics if k.endswith(".compute_s")]
    if walls:
        metrics["device.wall_s_max"] = max(walls)
        metrics["device.compute_s_max"] = max(computes)
    critical = critical_compute_s([report.measure for report in reports.values()])
    if critical is not None:
        metrics["device.critical_compute_s"] = critical
    metrics["device.absences"] = float(sum(len(report.absent) for report in reports.values()))
    return metrics
