"""`scripts/gpu-check.sh` is rehearsed here on the CPU (GPU_CHECK_DEVICE=cpu, tiny sizes): a GPU
is lent for minutes at a time, and a check that breaks in its plumbing (a path, a step's
arguments, the JSON it collects, a call cut off at its limit) would spend them on nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"
STEPS = ["gpu-bench", "pytest-cuda", "agreement", "run-fedavg", "profile"]


def _check(out: Path, **settings: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {
        **os.environ,
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_BENCH_ARGS": "--quick --models linear --fedavg-clients 8",
        "GPU_CHECK_FAMILIES": "fedavg",
        "GPU_CHECK_AGREEMENT_ARGS": "--methods fedavg",
        "GPU_CHECK_PROFILE_ARGS": "--cases p4:linear:8",
        "OMP_NUM_THREADS": "1",
        **settings,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    return done, json.loads((out / "check.json").read_text())


def test_the_gpu_check_runs_every_step_and_collects_its_json_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done, check = _check(out)
    assert done.returncode == check["failed_steps"] == 0, done.stderr[-3000:]
    assert [step["step"] for step in check["steps"]] == STEPS
    # few files, as a lent machine returns at most 8: the logs travel in one archive
    assert sorted(p.name for p in out.iterdir()) == [
        "agreement.json",
        "check.json",
        "device.json",
        "gpu.json",
        "logs.tar.gz",
        "runs.jsonl",
    ]
    with tarfile.open(out / "logs.tar.gz") as bundle:
        names = {Path(name).as_posix().removeprefix("./") for name in bundle.getnames()}
        pytest_log = bundle.extractfile("./pytest-cuda.log").read().decode()
    assert {f"{step}.log" for step in STEPS} <= names and "profile/profile.json" in names
    assert "skipped" in pytest_log  # collected, and skipped without CUDA
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


def test_steps_that_the_budget_leaves_no_time_for_are_recorded_as_skipped(tmp_path):
    done, check = _check(tmp_path / "out", GPU_CHECK_BUDGET_S="15")
    assert done.returncode == check["failed_steps"] == 0, done.stderr[-3000:]
    assert [(s["step"], s["status"]) for s in check["steps"]] == [
        (step, "skipped") for step in STEPS
    ]
