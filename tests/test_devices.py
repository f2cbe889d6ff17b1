"""`--device`: resolution and its errors, the memory plan, and runs on an accelerator.

Runs on an accelerator are checked twice: on the emulated `emu` device
(`p4bench.testing.emulated_device`, CPU arithmetic under CUDA's placement rules), which
runs everywhere, and on a real GPU in the tests marked `cuda`, which skip without one.
On `emu` the arithmetic is the CPU's, so its results must equal the CPU run's exactly;
on CUDA they must agree within floating-point tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.engine.devices import MemoryPlan, device_scope, plan_memory, resolve_device
from p4bench.errors import UsageError
from p4bench.rng import ClientRng, node_keys
from p4bench.run import interrupts
from p4bench.run.checkpoint import CHECKPOINT_FILE, load
from p4bench.run.runner import run
from p4bench.testing.emulated_device import EmulatedTensor, emulation, host_reads, reset_host_reads
from p4bench.testing.runs import StopAfterStep

# The methods the issue names for CPU/GPU equality, each with DP where it has it.
EQUALITY_CASES = {
    "p4": dict(method="p4", clients=8),
    "fedavg": dict(method="fedavg", epsilon=8.0),
    "proxyfl": dict(method="proxyfl"),
    "dp-dsgt": dict(method="dp-dsgt", epsilon=8.0),
}


def small(results_dir: str, **changes) -> RunConfig:
    base = dict(
        clients=6,
        rounds=2,
        local_steps=2,
        results_dir=results_dir,
        seed=3,
        noise_generator="philox",
    )
    return RunConfig(**{**base, **changes})


# -- resolution ------------------------------------------------------------------------------


def test_device_specs_resolve_or_fail_with_one_line():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cpu:1", "cuda:x", ""):
        with pytest.raises(UsageError, match="cpu, cuda, cuda:N, auto"):
            resolve_device(bad)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without CUDA"
)
def test_cuda_without_cuda_exits_2_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "local",
                "--clients",
                "4",
                "--rounds",
                "1",
                "--device",
                "cuda",
                "--results-dir",
                str(tmp_path),
            ]
        )
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: CUDA is not available"), (
        lines
    )
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was created
    with pytest.raises(SystemExit) as info:
        main(["sweep", "examples/grid.yaml", "--device", "cuda:3", "--results-dir", str(tmp_path)])
    assert info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_cpu_runs_keep_their_config_hashes():
    assert (
        RunConfig(device="cpu", noise_generator="auto").config_hash() == RunConfig().config_hash()
    )
    assert RunConfig(device="cuda").config_hash() != RunConfig().config_hash()


# -- memory plan -----------------------------------------------------------------------------


def test_memory_plan_streams_data_that_does_not_fit_and_refuses_state_that_does_not():
    gpu = torch.device("cuda", 0)
    resident = plan_memory(gpu, data_bytes=10 << 30, state_bytes=5 << 30, free=40 << 30)
    assert not resident.stream_data
    streamed = plan_memory(gpu, data_bytes=100 << 30, state_bytes=5 << 30, free=40 << 30)
    assert streamed.stream_data and streamed.summary()["device.data_placement"] == "streamed"
    with pytest.raises(UsageError) as refused:
        plan_memory(gpu, data_bytes=1 << 30, state_bytes=50 << 30, free=40 << 30)
    line = str(refused.value)
    assert (
        str(50 << 30) in line and str(40 << 30) in line and "\n" not in line
    )  # bytes needed and free, one line
    assert plan_memory(torch.device("cpu"), 1 << 40, 1 << 40) == MemoryPlan(
        torch.device("cpu"), 1 << 40, 1 << 40, None, False
    )


# -- runs on the emulated accelerator ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EQUALITY_CASES))
def test_runs_on_an_accelerator_equal_the_cpu_run(name, results_dir):
    config = small(results_dir, **EQUALITY_CASES[name])
    placed = {}

    def check_placement(prepared) -> None:
        placed["data"] = prepared.job.data.train.x
        with device_scope(prepared.device):
            placed["params"] = next(iter(prepared.job.method.initial_params().values()))

    with emulation():
        on_device = run(config.replace(device="emu"), track=False, on_prepared=check_placement)
    on_cpu = run(config, track=False)
    assert isinstance(placed["data"], EmulatedTensor) and isinstance(
        placed["params"], EmulatedTensor
    )
    assert on_device.summary["compute_device"] == "emu:0"
    np.testing.assert_array_equal(on_device.outcome.accuracy, on_cpu.outcome.accuracy)
    for key, value in on_cpu.outcome.final_params.items():
        assert torch.equal(on_device.outcome.final_params[key].cpu(), value)
    if config.epsilon is not None:
        assert on_device.summary["epsilon"] == on_cpu.summary["epsilon"]


@pytest.mark.parametrize("method", ["fedavg", "p4"])
def test_streamed_client_data_gives_the_resident_result(method, results_dir, monkeypatch):
    """Data kept in host memory (as when it does not fit on the GPU) and moved batch by
    batch, evaluated in chunks of clients: the same numbers as the CPU run."""
    import p4bench.run.runner as runner

    config = small(results_dir, method=method, clients=8, epsilon=8.0)
    placed = {}
    monkeypatch.setattr(
        runner, "plan_memory", lambda device, data, state: MemoryPlan(device, data, state, 0, True)
    )
    with emulation():
        streamed = run(
            config.replace(device="emu"),
            track=False,
            on_prepared=lambda prepared: placed.setdefault("x", prepared.job.data.train.x),
        )
    assert placed["x"].device.type == "cpu"
    assert streamed.summary["device.data_placement"] == "streamed"
    np.testing.assert_array_equal(
        streamed.outcome.accuracy, run(config, track=False).outcome.accuracy
    )


def test_philox_noise_is_seeded_and_differs_from_the_torch_generators(results_dir):
    config = small(results_dir, method="fedavg", epsilon=8.0)
    first, again = run(config, track=False), run(config, track=False)
    np.testing.assert_array_equal(first.outcome.accuracy, again.outcome.accuracy)
    torch_noise = run(config.replace(noise_generator="torch"), track=False)
    assert not all(
        torch.equal(first.outcome.final_params[k], torch_noise.outcome.final_params[k])
        for k in first.outcome.final_params
    )


# -- the same on a real GPU (skipped without CUDA) ---------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(EQUALITY_CASES))
def test_cuda_runs_match_the_cpu_run_within_tolerance(name, results_dir):
    config = small(results_dir, **EQUALITY_CASES[name])
    on_gpu = run(config.replace(device="cuda"), track=False)
    on_cpu = run(config, track=False)
    assert on_gpu.summary["compute_device"].startswith("cuda:")
    # float32 arithmetic in another order (cuBLAS), the same Philox noise: measured on an H100
    # (bench/gpu_agreement.py), the parameters of these runs agree within 3e-8 (2.4e-7 relative)
    # and every client's accuracy is equal; 1e-6 / 1e-5 leave 30x room for other cards and libraries
    for key, value in on_cpu.outcome.final_params.items():
        torch.testing.assert_close(
            on_gpu.outcome.final_params[key].cpu(), value, rtol=1e-5, atol=1e-6
        )
    assert math.isclose(
        on_gpu.summary["accuracy_mean"], on_cpu.summary["accuracy_mean"], abs_tol=0.02
    )


@pytest.mark.cuda
def test_philox_streams_give_the_cpu_words_on_cuda():
    """The counter-based streams are integer arithmetic (64-bit products that wrap): the
    GPU must give the CPU's words bit for bit, and normals to float64 rounding."""
    keys = node_keys(5, list(range(300)))
    on_cpu = ClientRng(keys)
    with device_scope(
        torch.device("cuda")
    ):  # as in a run: the draw counters live on the device too
        on_gpu = ClientRng(keys.cuda())
    assert torch.equal(on_gpu.bits(1001).cpu(), on_cpu.bits(1001))
    assert torch.equal(on_gpu.uniform(257).cpu(), on_cpu.uniform(257))
    torch.testing.assert_close(on_gpu.normal(513).cpu(), on_cpu.normal(513), rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
def test_p4_scatter_cnn_runs_on_cuda_with_secure_noise(results_dir):
    config = small(
        results_dir,
        method="p4",
        clients=8,
        model="scatter-cnn",
        features="scatter",
        rounds=1,
        noise_source="secure",
    )
    result = run(config.replace(device="cuda"), track=False)
    assert result.summary["compute_device"].startswith("cuda:") and math.isfinite(
        result.summary["accuracy_mean"]
    )


@pytest.mark.parametrize(("first", "second"), [("emu", "emu"), ("emu", "cpu")])
def test_a_run_interrupted_on_an_accelerator_resumes_to_the_uninterrupted_result(
    first, second, tmp_path
):
    """Checkpoints hold host tensors (and the Philox noise counters), so a run resumes on
    the same or another device and ends where the uninterrupted run ends."""
    config = RunConfig(
        method="fedavg",
        epsilon=8.0,
        clients=6,
        rounds=4,
        local_steps=2,
        seed=1,
        noise_generator="philox",
        results_dir=str(tmp_path / "runs"),
        tracking_uri=f"sqlite:///{tmp_path / 'store.db'}",
    )
    uninterrupted = run(config).summary["accuracy_per_client"]
    interrupts.clear_stop()
    with pytest.raises(interrupts.RunInterrupted) as stopped:
        with emulation():
            run(config.replace(device=first), observers=[StopAfterStep(2)])
    interrupts.clear_stop()
    folder = Path(stopped.value.results_dir)
    saved = torch.load(folder / CHECKPOINT_FILE, weights_only=True)
    assert all(t.device.type == "cpu" for t in _tensors(saved))
    checkpoint = load(folder)
    with emulation():
        resumed = run(
            RunConfig(**{**checkpoint.config, "device": second}), resume=checkpoint
        ).summary
    assert resumed["accuracy_per_client"] == uninterrupted


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _host_reads_of_one_round(method: str, clients: int, results_dir: str, **changes) -> int:
    counts = []
    for rounds in (1, 2):
        with emulation():
            reset_host_reads()
            run(
                small(
                    results_dir,
                    method=method,
                    clients=clients,
                    rounds=rounds,
                    device="emu",
                    **changes,
                ),
                track=False,
            )
            counts.append(host_reads())
    return counts[1] - counts[0]


@pytest.mark.parametrize(
    ("method", "changes"),
    [
        ("fedavg", {"epsilon": 8.0}),
        ("p4", {}),
        ("dp-dsgt", {"epsilon": 8.0}),
        ("dp-dsgt", {"epsilon": 8.0, "options": {"equivocation": "none"}}),
        ("proxyfl", {}),
        ("pdsl", {}),
    ],
)
def test_reads_back_to_the_host_per_round_do_not_grow_with_the_clients(
    method, changes, results_dir
):
    """A round reads a bounded number of values back to the host (batch widths, the
    ledger's stepping clients, the report), never one per client: on a GPU each is a sync."""
    few = _host_reads_of_one_round(method, 10, results_dir, **changes)
    many = _host_reads_of_one_round(method, 30, results_dir, **changes)
    # DP-DSGT's two gossip exchanges run the equivocation check: its digests, signatures and
    # report comparison are host work, a fixed number of reads per covered exchange
    checked = method == "dp-dsgt" and changes.get("options", {}).get("equivocation") != "none"
    limit = 90 if checked else 60
    assert many == few and few < limit, (few, many)
