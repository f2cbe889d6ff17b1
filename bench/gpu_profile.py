"""Where one round of bench/gpu.py's configurations spends its time: torch.profiler over
one round (after a warm-up round), on the CPU or a CUDA device.

Per configuration it prints, and writes as JSON under `--out`:
- `round_s` of the profiled round (profiling slows it: compare with bench/gpu.py);
- `ops`: the aten operators the round dispatched (each one a kernel launch on a GPU),
  and `host_syncs`: the device-to-host copies and stream synchronisations (each one a
  stall of the host until the device has drained its queue);
- `device_busy_s`: the summed time of the device's kernels (CUDA only); against
  `round_s`, how much of the round the device is idle (launch-bound when small);
- the 25 operators with the most self time on the host and on the device.
The full tables go to `<out>/profile-<method>-<model>-<clients>.txt`.

    python bench/gpu_profile.py [--device auto] [--cases p4:linear:260,p4:scatter-cnn:260,fedavg:linear:100000]
                                [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu import (
    CLASSES,
    FEATURES,
    FEDAVG_FEATURES,
    FEDAVG_SAMPLES,
    FEDAVG_TEST,
    FULL_SAMPLES,
    GROUP,
    RATE,
    STEPS,
    TimedNetwork,
    TimedRuntime,
    build_job,
    cli_device,
    synthetic_data,
)
from torch.profiler import ProfilerActivity, profile

from p4bench.config import RunConfig
from p4bench.engine.devices import device_scope, synchronize
from p4bench_p4.method import COTRAINING

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class ProfiledNetwork(TimedNetwork):
    """Profiles the round `profile_round` (torch.profiler) instead of timing it."""

    def __init__(self, device: torch.device, profile_round: int, phase: str | None) -> None:
        super().__init__(device, count_round=-1, phase=phase)
        self.profile_round = profile_round
        self.profiler: Any = None
        self.profiled_s: float | None = None

    def begin_round(self, phase: str, round_index: int) -> None:
        super().begin_round(phase, round_index)
        if (self.phase is None or phase == self.phase) and round_index == self.profile_round:
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            )
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self._started = time.perf_counter()

    def steps_finished(self, phase: str, round_index: int) -> None:
        if (
            self.profiler is not None
            and (self.phase is None or phase == self.phase)
            and round_index == self.profile_round
        ):
            synchronize(self.device)
            self.profiled_s = time.perf_counter() - self._started
            self.profiler.__exit__(None, None, None)
            return
        super().steps_finished(phase, round_index)


def profile_case(
    method: str, model: str, clients: int, device: torch.device, out: Path
) -> dict[str, Any]:
    p4 = method == "p4"
    samples, test, features = (
        (FULL_SAMPLES, 40, FEATURES) if p4 else (FEDAVG_SAMPLES, FEDAVG_TEST, FEDAVG_FEATURES)
    )
    data = synthetic_data(clients, samples, test, device, features=features)
    options = {"group_size": min(GROUP, clients), "samples": min(35, clients - 1)} if p4 else {}
    config = RunConfig(
        method=method,
        model=model,
        clients=clients,
        rounds=2,
        local_steps=STEPS,
        data_rate=RATE,
        client_rate=1.0,
        lr=0.5,
        device=str(device),
        options=options,
    )
    network = ProfiledNetwork(device, profile_round=1, phase=COTRAINING if p4 else None)
    with device_scope(device):
        job, _ = build_job(config, model, data)
        TimedRuntime(network).execute(job, lambda report: None)
    events = network.profiler.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = sum(e.count for e in events if e.key in SYNC_NAMES)
    d2h = sum(
        e.count
        for e in events
        if "DtoH" in e.key or e.key == "aten::item" or e.key == "aten::_local_scalar_dense"
    )
    device_sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    stem = f"profile-{method}-{model}-{clients}"
    tables = {
        "host": events.table(sort_by="self_cpu_time_total", row_limit=25),
        "device": events.table(sort_by=device_sort, row_limit=25),
        "count": events.table(sort_by="count", row_limit=25),
    }
    (out / f"{stem}.txt").write_text("\n\n".join(f"== by {k} ==\n{v}" for k, v in tables.items()))
    busy = sum(
        getattr(e, "self_device_time_total", 0)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    result = {
        "method": method,
        "model": model,
        "clients": clients,
        "round_s": network.profiled_s,
        "ops": ops,
        "host_syncs": syncs,
        "item_or_dtoh": d2h,
        "device_busy_s": busy / 1e6 if device.type == "cuda" else None,
        "top_host": [
            (e.key, e.count, round(e.self_cpu_time_total / 1e3, 3))
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
        ],
    }
    if device.type == "cuda":
        result["top_device"] = [
            (e.key, e.count, round(e.self_device_time_total / 1e3, 3))
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--cases",
        default="p4:linear:260,p4:scatter-cnn:260,fedavg:linear:100000",
        help="method:model:clients, comma-separated",
    )
    parser.add_argument("--out", default=".", help="folder for the tables and profile.json")
    args = parser.parse_args(argv)
    device = cli_device(args.device)
    if device is None:
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        method, model, clients = case.split(":")
        try:
            result = profile_case(method, model, int(clients), device, out)
        except Exception as exc:  # noqa: BLE001 - reported; the other cases still run
            result = {"case": case, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        results.append(result)
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "profile.json").write_text(
        json.dumps({"device": str(device), "classes": CLASSES, "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
