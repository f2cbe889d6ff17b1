"""Reading what peers report to the launcher: numeric fields (anything else counts as
missing), the `measure` object, the round's critical compute path, and the deployed
parameters of the states peers send back at the end."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from p4bench.engine.method import Method
from p4bench.engine.state import State, cat_rows
from p4bench.models import Params

__all__ = ["add_measure", "critical_compute_s", "deployed_from_states", "finish_summary", "measure_of", "number",
           "peer_round_metrics"]

log = logging.getLogger("p4bench.device")


def number(value: Any, default: float = 0.0) -> float:
    """A report's numeric field: a finite int or float (not a bool), else `default`."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) else default


def measure_of(report: dict[str, Any]) -> dict[str, Any]:
    """A report's `measure` object ({} when missing or not an object)."""
    measure = report.get("measure")
    return measure if isinstance(measure, dict) else {}


def critical_compute_s(measures: list[dict[str, Any]]) -> float | None:
    """The round's period (previous round's end to this one's) were communication free:
    every exchange waits for all peers' end markers, so each compute segment between two
    exchanges lasts as long as its slowest peer's; the first segment starts with the work
    between rounds (evaluation, report). None unless every peer reported the same number of
    numeric segments."""
    try:
        peers = [[float(m["between_rounds_s"]) + float(m["compute_segments"][0]),
                  *(float(v) for v in m["compute_segments"][1:])] for m in measures]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    if not peers or len({len(s) for s in peers}) != 1:
        return None
    return sum(max(column) for column in zip(*peers))


def deployed_from_states(method: Method, states: dict[int, State], count: int) -> tuple[Params, State | None]:
    """(every client's deployed parameters, NaN for a peer that sent no usable state;
    the stacked state of all clients when every peer sent one and they stack)."""
    template = method.initial_params()
    params = {k: torch.full((count, *v.shape), float("nan"), dtype=v.dtype) for k, v in template.items()}
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


def finish_summary(finish: dict[str, Any], finals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The time budget's stop (`finish`: the step the launcher told every peer to stop
    after) beside the step each peer says it stopped after, and whether they all agree."""
    stopped = {peer: finals[peer].get("stopped_after_step") for peer in sorted(finals)}
    consistent = set(stopped.values()) == {finish["after_step"]}
    if not consistent:
        log.warning("time budget: the peers stopped after steps %s, not all after %d", stopped, finish["after_step"])
    return {**finish, "stopped_after_step": stopped, "consistent": consistent}


def add_measure(totals: dict[str, Any], measure: dict[str, Any]) -> None:
    """Add one report's measurements to a peer's phase totals (times, bytes, peak memory,
    energy where a power meter reported watts, and per-exchange figures)."""
    for key in ("wall_s", "compute_s", "comm_s", "eval_s", "cpu_s", "wire_bytes_sent", "wire_bytes_received"):
        totals[key] = totals.get(key, 0) + number(measure.get(key))
    totals["peak_rss_mb"] = max(totals.get("peak_rss_mb", 0.0), number(measure.get("peak_rss_mb")))
    watts = measure.get("power_w")
    if isinstance(watts, (int, float)) and not isinstance(watts, bool):
        totals["energy_j"] = totals.get("energy_j", 0.0) + watts * number(measure.get("wall_s"))
        totals["metered_s"] = totals.get("metered_s", 0.0) + number(measure.get("wall_s"))
        totals["power_w"] = totals["energy_j"] / max(totals["metered_s"], 1e-12)  # time-weighted mean
    for name, figures in (measure.get("exchanges") or {}).items():
        if isinstance(figures, dict):
            entry = totals["exchanges"].setdefault(str(name), {})
            for key, value in figures.items():
                entry[key] = entry.get(key, 0) + number(value)


def peer_round_metrics(peer: str, measure: dict[str, Any]) -> dict[str, float]:
    """A peer's round measurements as `device.<peer>.*` metrics, with each exchange's
    transfer time next to the link's capacity."""
    metrics: dict[str, float] = {}
    for key in ("wall_s", "compute_s", "comm_s", "cpu_s", "between_rounds_s", "peak_rss_mb", "wire_bytes_sent",
                "wire_bytes_received", "power_w"):
        if isinstance(measure.get(key), (int, float)):
            metrics[f"device.{peer}.{key}"] = float(measure[key])
    for name, figures in (measure.get("exchanges") or {}).items():
        if isinstance(figures, dict):
            prefix = f"device.{peer}.exchange.{name}"
            metrics[f"{prefix}.comm_s"] = max(number(figures.get("wall_s")) - number(figures.get("compute_s")), 0.0)
            metrics[f"{prefix}.wire_bytes_sent"] = number(figures.get("wire_bytes_sent"))
            metrics[f"{prefix}.messages_sent"] = number(figures.get("messages_sent"))
    return metrics
