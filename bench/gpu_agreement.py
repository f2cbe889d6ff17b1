"""How close a CUDA run is to the CPU run of the same seed, with the same noise
(`--noise-generator philox` on both): the figure behind tests/test_devices.py's tolerance.

For each method (DP on where it has DP), the run is made on the CPU and on the GPU; the
JSON gives the largest absolute and relative difference of the final parameters, the
largest difference of a client's test accuracy, and the printed epsilons. The last line
of stdout is one JSON object; without CUDA it exits 2.

    python bench/gpu_agreement.py [--device cuda] [--methods p4,fedavg,proxyfl,dp-dsgt,p4:scatter-cnn]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
from gpu import cli_device  # bench/gpu.py, beside this script

from p4bench.config import RunConfig
from p4bench.engine.devices import describe_device
from p4bench.run.runner import run

CASES = {
    "p4": dict(method="p4", clients=8),
    "fedavg": dict(method="fedavg", epsilon=8.0),
    "proxyfl": dict(method="proxyfl"),
    "dp-dsgt": dict(method="dp-dsgt", epsilon=8.0),
    "p4:scatter-cnn": dict(method="p4", clients=8, model="scatter-cnn", features="scatter"),
}


def compare(case: dict, device: str, folder: str) -> dict:
    config = RunConfig(
        **{
            **dict(
                clients=6,
                rounds=2,
                local_steps=2,
                results_dir=folder,
                seed=3,
                noise_generator="philox",
            ),
            **case,
        }
    )
    on_cpu, on_gpu = run(config, track=False), run(config.replace(device=device), track=False)
    abs_diff, rel_diff = 0.0, 0.0
    for key, value in on_cpu.outcome.final_params.items():
        other = on_gpu.outcome.final_params[key].cpu().double()
        difference = (other - value.double()).abs().max().item()
        abs_diff = max(abs_diff, difference)
        rel_diff = max(rel_diff, difference / max(value.double().abs().max().item(), 1e-30))
    accuracy = np.abs(np.asarray(on_gpu.outcome.accuracy) - np.asarray(on_cpu.outcome.accuracy))
    return {
        "max_abs_param_diff": abs_diff,
        "max_rel_param_diff": rel_diff,
        "max_client_accuracy_diff": float(accuracy.max()) if accuracy.size else 0.0,
        "epsilon_cpu": on_cpu.summary.get("epsilon"),
        "epsilon_gpu": on_gpu.summary.get("epsilon"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default=",".join(CASES), help=f"of {list(CASES)}")
    args = parser.parse_args(argv)
    device = cli_device(args.device)
    if device is None:
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.methods.split(","):
            if name not in CASES:
                parser.error(f"unknown method case {name!r}, choose from {list(CASES)}")
            try:
                results[name] = compare(CASES[name], str(device), folder)
            except Exception as exc:  # noqa: BLE001 - reported; the other cases still run
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(name, results[name], file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "benchmark": "gpu_agreement",
                "device": describe_device(device),
                "torch": torch.__version__,
                "noise_generator": "philox",
                "results": results,
            }
        )
    )
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
