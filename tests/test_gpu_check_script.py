"""`scripts/gpu-check.sh` is rehearsed here on the CPU (GPU_CHECK_DEVICE=cpu, tiny sizes): a GPU
is lent for minutes at a time, and a check that breaks in its plumbing (a path, a step's
arguments, the JSON it collects) would spend them on nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"


def test_the_gpu_check_runs_every_step_and_collects_its_json_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_BENCH_ARGS": "--quick --models linear --fedavg-clients 8",
        "GPU_CHECK_FAMILIES": "fedavg",
        "GPU_CHECK_AGREEMENT_ARGS": "--methods fedavg",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    check = json.loads((out / "check.json").read_text())
    assert done.returncode == check["failed_steps"] == 0, done.stderr[-3000:]
    steps = [step["step"] for step in check["steps"]]
    assert steps == ["pytest-cuda", "gpu-bench", "run-fedavg", "agreement"]
    assert "skipped" in (out / "pytest-cuda.log").read_text()  # collected, and skipped without CUDA
    bench = json.loads((out / "gpu.json").read_text())
    assert bench["device"] == "cpu" and bench["failed"] == 0
    assert {(r["method"], r["model"]) for r in bench["results"]} == {
        ("p4", "linear"),
        ("fedavg", "linear"),
    }
    (summary,) = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert summary["method"] == "fedavg" and summary["compute_device"] == "cpu"
    assert summary["rounds_completed"] == 2 and summary["private"] is True
    agreement = json.loads((out / "agreement.json").read_text())
    assert agreement["noise_generator"] == "philox"
    assert agreement["results"]["fedavg"]["max_abs_param_diff"] == 0.0  # the CPU against itself
