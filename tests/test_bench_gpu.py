"""bench/gpu.py: the JSON of a quick CPU run, usage errors, per-configuration failures
and the corrected FLOP count of per-sample convolution gradients."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "gpu.py"
RESULT_KEYS = {
    "method",
    "model",
    "clients",
    "round_s",
    "rounds_s",
    "first_round_s",
    "per_client_ms",
    "flops_per_round",
    "tflops",
    "fraction_of_peak",
    "peak_memory_bytes",
    "path",
    "num_parameters",
    "config_wall_s",
}


def run_bench(*args: str) -> subprocess.CompletedProcess:
    # no wall-clock limit: the CPU run takes what a busy machine gives it (issue 45)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=BENCH.parent
    )


def check_output(out: dict, device_type: str, precisions: tuple[str, ...] = ("fp32",)) -> None:
    assert out["benchmark"] == "gpu" and out["device_type"] == device_type and out["failed"] == 0
    assert out["torch"] == torch.__version__ and out["device"]
    assert (
        out["config"]["quick"] is True
        and out["config"]["local_steps"] == 5
        and out["config"]["data_rate"] == 0.5
    )
    assert (
        out["config"]["features"] == [243, 8, 8] and out["config"]["dp"]["noise_multiplier"] == 1.0
    )
    assert out["config"]["noise_generator"] == ("torch" if device_type == "cpu" else "philox")
    assert out["reduced"] is True and "reduced" in out["reduced_note"]
    assert math.isfinite(out["peak_tflops"]) and out["peak_tflops"] > 0
    assert "FlopCounterMode" in out["flops_method"]
    assert [
        (r["method"], r["model"], r["clients"], r.get("private_precision")) for r in out["results"]
    ] == [
        ("p4", "linear", 4, None),
        *(("p4", "scatter-cnn", 4, precision) for precision in precisions),
        ("fedavg", "linear", 8, None),
    ]
    assert out["config"]["private_precision"] == list(precisions)
    assert (
        out["config"]["fedavg"]["clients"] == 8
        and out["config"]["fedavg"]["dp"]["neighbouring"] == "add-remove"
    )
    for result in out["results"]:
        assert set(result) - {"private_precision"} == RESULT_KEYS, result
        for key in (
            "round_s",
            "first_round_s",
            "per_client_ms",
            "flops_per_round",
            "tflops",
            "fraction_of_peak",
            "peak_memory_bytes",
        ):
            assert math.isfinite(result[key]) and result[key] > 0, (key, result)
        assert result["per_client_ms"] == pytest.approx(
            result["round_s"] / result["clients"] * 1000, rel=1e-3
        )
        assert result["tflops"] == pytest.approx(
            result["flops_per_round"] / result["round_s"] / 1e12, rel=1e-3
        )
        assert len(result["rounds_s"]) == out["config"]["timed_rounds"] == 1
    linear, cnn, *_, fedavg = out["results"]
    assert (
        linear["path"] in ("span", "buckets")
        and cnn["path"] in ("autograd", "stacked")
        and fedavg["path"] == "dp-sgd"
    )
    assert (
        cnn["flops_per_round"] > linear["flops_per_round"]
    )  # convolutions over 243 channels, and 5 steps of them


def test_quick_cpu_run_prints_one_json_object():
    done = run_bench("--device", "cpu", "--quick", "--private-precision", "fp32,tf32")
    assert done.returncode == 0, done.stderr[-3000:]
    check_output(json.loads(done.stdout.strip().splitlines()[-1]), "cpu", ("fp32", "tf32"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_usage_error():
    done = run_bench("--device", "cuda", "--quick")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: CUDA is not available"), (
        done.stderr
    )
    assert done.stdout == ""


@pytest.mark.cuda
def test_quick_cuda_run():
    # with P4's private model in TF32 too (option private_precision; the DP step stays float32)
    done = run_bench("--device", "cuda", "--quick", "--private-precision", "fp32", "tf32")
    assert done.returncode == 0, done.stderr[-3000:]
    check_output(json.loads(done.stdout.strip().splitlines()[-1]), "cuda", ("fp32", "tf32"))


@pytest.fixture
def gpu_bench(monkeypatch):
    """bench/gpu.py as a module (it imports bench/p4.py by its script-relative name)."""
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("gpu", "p4"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("gpu")
    for name in ("gpu", "p4"):
        sys.modules.pop(name, None)


def test_a_failing_configuration_is_reported_and_the_others_run(gpu_bench, monkeypatch, capsys):
    def run_config(config, model_name, data, device):
        if model_name == "scatter-cnn":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail"
            )
        return {"round_s": 0.5, "per_client_ms": 125.0, "tflops": 1e-3}

    monkeypatch.setattr(gpu_bench, "run_config", run_config)
    assert (
        gpu_bench.main(["--device", "cpu", "--quick", "--clients", "4,5", "--fedavg-clients", "0"])
        == 1
    )  # after the JSON
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["failed"] == 2 and out["config"]["clients"] == [4, 5]
    assert [(r["model"], r["clients"], "error" in r) for r in out["results"]] == [
        ("linear", 4, False),
        ("scatter-cnn", 4, True),
        ("linear", 5, False),
        ("scatter-cnn", 5, True),
    ]
    assert (
        out["results"][1]["error"]
        == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    )
    assert out["results"][0]["fraction_of_peak"] > 0


def test_per_sample_convolution_gradients_are_counted_once(gpu_bench):
    """torch counts the weight gradient of a grouped convolution groups times over; the
    per-sample gradients of vmap are one; bench/gpu.py's formula counts them as the
    batch gradient's multiplications (the same products, not summed)."""
    from torch.func import grad, vmap
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(6, 16, 8, 8), torch.randn(8, 16, 3, 3)

    def loss(w, x):
        return torch.nn.functional.conv2d(x, w, padding=1).square().sum()

    mapping = {torch.ops.aten.convolution_backward: gpu_bench.conv_backward_flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as batch:
        grad(loss)(w, x)
    with FlopCounterMode(display=False, custom_mapping=mapping) as per_sample:
        vmap(grad(loss), in_dims=(None, 0))(w, x[:, None])
    with FlopCounterMode(display=False) as torch_count:
        vmap(grad(loss), in_dims=(None, 0))(w, x[:, None])
    forward = 2 * 6 * 8 * 16 * 9 * 64
    assert batch.get_total_flops() == per_sample.get_total_flops() == 2 * forward
    assert torch_count.get_total_flops() == forward + 6 * forward  # what the correction removes
    with FlopCounterMode(display=False, custom_mapping=mapping) as both:  # input gradient too
        grad(loss, argnums=(0, 1))(w, x)
    assert both.get_total_flops() == 3 * forward


def test_the_plan_of_the_issue_sizes_is_printed_without_a_gpu_and_counts_every_part():
    done = run_bench("--plan")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by = {(r["method"], r["model"], r["clients"]): r for r in rows if "method" in r}
    big = by[("p4", "scatter-cnn", 2080)]
    for part in ("data_bytes", "state_bytes", "grouping_bytes", "dp_step_bytes_per_client"):
        assert big[part] > 0, part
    # per-example gradients of every client at once would not fit: the plan chunks them
    assert (
        big["dp_step_all_clients_bytes"]
        > rows[-1]["card_bytes"]
        > big["fixed_groups"]["needed_bytes"]
    )
    assert 1 <= big["fixed_groups"]["clients_per_chunk"] < 2080
    assert rows[-1]["all_fit_as_bench_gpu_runs_them"] is True
