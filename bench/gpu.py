"""P4 co-training rounds on an accelerator: seconds per round, FLOP/s against the device's peak, memory.

Workload (the CIFAR-10 shape of bench/p4.py): clients with 160 training samples each,
243x8x8 ScatterNet-shaped synthetic features, 10 classes, K = 5 local steps, s = 0.5,
groups of 8, every member trains each round (l = 1), DP on the proxy (sigma = 1, C = 1,
replace-one), no defense (as bench/p4.py); models `linear` and `scatter-cnn`, at 260 and
2,080 clients. The round runs through the real engine, as bench/p4.py does: the P4
method plugin, the DP mechanism (`attach_mechanisms`; seeded noise from the Philox
streams on accelerators, torch's generators on the CPU: the runner's `auto`) and the
batched simulator (`SimulationRuntime`), built inside `p4bench.engine.devices.device_scope`
with the data drawn on the device (resident, never streamed from host memory).

Per configuration (model x clients):
- `round_s`: the median over `--rounds` timed co-training rounds, after one warm-up
  round (the first also pays one-time costs: the span path's QR bases, kernel
  selection). A round is timed from the network's `begin_round` to its `steps_finished`
  hooks (the round's steps, not its evaluation) with `p4bench.engine.devices.synchronize`
  before both clock reads, so queued GPU work is counted in the round that queued it;
  `per_client_ms` = round_s / clients * 1000;
- `flops_per_round`: counted, not modelled: one more co-training round after the timed
  ones runs under `torch.utils.flop_counter.FlopCounterMode`, which counts the matrix
  products and convolutions (forward and backward) at the shapes really executed:
  elementwise work, norms, the noise and the sampling are not counted, so the achieved
  rate is a lower bound on the useful arithmetic. torch's formula for a convolution's
  weight gradient counts a grouped convolution groups times over, which the simulator's
  per-sample gradients (vmap: one group per sample) are: `conv_backward_flop` counts it
  once (torch's own count is several times too high for scatter-cnn).
  `tflops` = flops_per_round / round_s;
- `peak_tflops` (top level): the device's fp32 matmul rate measured in this run, best of
  several square products before and after the configurations (the strictest peak);
  `fraction_of_peak` = tflops / peak_tflops. On CUDA, `tf32` says whether fp32 matmuls
  may use TF32 (torch's default: no), for the peak and the rounds alike;
- `peak_memory_bytes`: CUDA: `torch.cuda.max_memory_allocated` since a reset at the
  start of the configuration (data, state and temporaries); CPU: the process's peak RSS
  (`resource.getrusage`), a high-water mark that includes earlier configurations.
A configuration that fails (out of memory, a device-placement bug) reports its `error`
and the others still run; the exit status is then 1, after the JSON.

The issue's sizes (260 and 2,080 clients of 160 samples) are for GPUs; on other devices
the defaults are reduced (8 clients of 32 samples, `reduced` says so in the JSON) to
finish in well under a minute on 2 cores; `--quick` is tinier still (CI).
The last line of stdout is one JSON object; `--device cuda` without CUDA exits 2.

    python bench/gpu.py [--device auto] [--clients 260,2080] [--samples 160] [--models linear,scatter-cnn]
                        [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import sys
import time
from typing import Any

import torch
from p4 import CLASSES, FEATURES  # bench/p4.py: the CIFAR-10 workload's shape
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from p4bench.config import RunConfig
from p4bench.data import ClientTensors, FederatedData
from p4bench.engine import Job, Phase
from p4bench.engine.devices import describe_device, device_scope, resolve_device, synchronize
from p4bench.engine.network import InProcessNetwork
from p4bench.engine.precision import PRECISIONS
from p4bench.engine.runtime import SimulationRuntime
from p4bench.errors import UsageError
from p4bench.models import LinearSoftmax, ScatterCNN
from p4bench.privacy.groups import attach_mechanisms, noise_generator
from p4bench.privacy.mechanism import DPSettings
from p4bench_baselines.fedavg import FedAvg
from p4bench_p4.method import COTRAINING, P4
from p4bench_p4.span import span_is_cheaper

MODELS = {"linear": LinearSoftmax, "scatter-cnn": ScatterCNN}
FULL_CLIENTS, FULL_SAMPLES = [260, 2080], 160  # the sizes
REDUCED_CLIENTS, REDUCED_SAMPLES = [8], 32  # devices other than CUDA
QUICK_CLIENTS, QUICK_SAMPLES = [4], 8  # --quick (CI)
STEPS, RATE, GROUP, SIGMA, CLIP = 5, 0.5, 8, 1.0, 1.0
# DP-FedAvg at scale (a linear model on digits-shaped clients: 8x8 features, every client in every round)
FULL_FEDAVG, REDUCED_FEDAVG, QUICK_FEDAVG = 100_000, 2_000, 8
FEDAVG_FEATURES, FEDAVG_SAMPLES, FEDAVG_TEST = (1, 8, 8), 20, 4
CHUNK = 128  # clients drawn at once (bounds the temporaries of building 2,080 clients' data)


def synthetic_data(
    clients: int,
    train: int,
    test: int,
    device: torch.device,
    seed: int = 0,
    features: tuple[int, ...] = FEATURES,
) -> FederatedData:
    """bench/p4.py's synthetic clients (class centres plus noise) with the sizes as
    parameters, drawn on `device` itself: at 2,080 clients the samples are 26 GB, which
    the host would draw far slower than the GPU."""
    torch.manual_seed(seed)  # the default generators of the CPU and every CUDA device
    with device_scope(device):
        centers = torch.randn(CLASSES, *features)
        chunk = max(
            CHUNK, (1 << 24) // max(train * math.prod(features), 1)
        )  # small clients: larger chunks

        def split(count: int) -> ClientTensors:
            y = torch.randint(0, CLASSES, (clients, count))
            x = torch.empty(clients, count, *features)
            for start in range(0, clients, chunk):
                rows = slice(start, start + chunk)
                x[rows] = torch.randn(x[rows].shape).add_(centers[y[rows]], alpha=0.3)
            return ClientTensors(x, y, torch.full((clients,), count))

        data = FederatedData(
            split(train),
            split(test),
            torch.zeros(clients, dtype=torch.bool),
            CLASSES,
            features,
            tuple(map(str, range(CLASSES))),
            tuple(),
        )
    return data.to(
        device
    )  # the runner's placement (p4bench.run.runner.prepare): here already there


def fresh(data: FederatedData) -> FederatedData:
    """The same tensors without the caches a run leaves on them (the span path's
    per-dataset QR bases are as large as the samples): each configuration starts clean."""

    def clean(t: ClientTensors) -> ClientTensors:
        return ClientTensors(t.x, t.y, t.n)

    return FederatedData(
        clean(data.train),
        clean(data.test),
        data.evaluation,
        data.num_classes,
        data.feature_shape,
        data.class_names,
        data.client_indices,
    )


def conv_backward_flop(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _output_padding,
    groups,
    output_mask,
    out_shape,
    **kwargs,
) -> int:
    """torch's formula for `convolution_backward` (torch 2.13), with the weight gradient
    of a grouped convolution divided by its groups: torch counts it as if every group
    saw every input channel. The per-sample gradients of the simulator (vmap) run as
    convolutions with one group per sample, so torch's own count is samples x too high."""
    flops = 0
    if output_mask[0]:  # grad_input: a transposed convolution of grad_out with the weight
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[
        1
    ]:  # grad_weight: a convolution of the input with grad_out, batch and channels swapped

        def swap(shape):
            return [shape[1], shape[0], *shape[2:]]

        first, second = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        flops += conv_flop_count(swap(first), swap(second), swap(out_shape[1])) // groups
    return flops


class TimedNetwork(InProcessNetwork):
    """The simulator's in-process network, timing every co-training round between the
    driver's `begin_round` and `steps_finished` hooks (device synchronised at both),
    and counting the FLOPs of round `count_round` instead of timing it."""

    def __init__(
        self, device: torch.device, count_round: int, phase: str | None = COTRAINING
    ) -> None:
        self.device, self.count_round, self.phase = device, count_round, phase
        self.seconds: list[float] = []
        self.flops: int | None = None
        self.counter: FlopCounterMode | None = None
        self._started = 0.0

    def begin_round(self, phase: str, round_index: int) -> None:
        if round_index < 0 or (
            self.phase is not None and phase != self.phase
        ):  # setup blocks are not rounds
            return
        if round_index == self.count_round:
            self.counter = FlopCounterMode(
                display=False,
                custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flop},
            )
            self.counter.__enter__()
        synchronize(self.device)
        self._started = time.perf_counter()

    def steps_finished(self, phase: str, round_index: int) -> None:
        if round_index < 0 or (
            self.phase is not None and phase != self.phase
        ):  # setup blocks are not rounds
            return
        synchronize(self.device)
        elapsed = time.perf_counter() - self._started
        if self.counter is not None:
            self.close()
        else:
            self.seconds.append(elapsed)

    def close(self) -> None:
        """Leave the FLOP counter (also when the round failed inside it)."""
        if self.counter is not None:
            counter, self.counter = self.counter, None
            counter.__exit__(None, None, None)
            self.flops = int(counter.get_total_flops())


class TimedRuntime(SimulationRuntime):
    """The batched simulator with a `TimedNetwork`."""

    def __init__(self, timed: TimedNetwork) -> None:
        super().__init__()
        self.timed = timed

    def network(self) -> TimedNetwork:
        return self.timed


def peak_tflops(device: torch.device, size: int, repeats: int) -> float:
    """The device's fp32 matmul rate: best of `repeats` square `size` products, timed
    with the device synchronised (the strictest peak)."""
    with device_scope(device):
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: kernel selection, workspace
        best = math.inf
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            a @ b
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (
        1 if sys.platform == "darwin" else 1024
    )


class FixedGroupsP4(P4):
    """P4's co-training (phase 2) on fixed groups of V consecutive clients, without phase 1.

    The timed rounds are phase 2's; phase 1 (similarity grouping) builds every client's
    view of the M x M dissimilarities from M(M-1) shares of M values: cubic in M (36 GB per
    copy at 2,080 clients, the scale issue's work), and it would not fit beside the data
    on one GPU. Phase 2 does not depend on how the groups were formed."""

    def phases(self):
        return [Phase(COTRAINING, self.config.rounds)]

    def init_client_state(self, train, ctx):
        state = super().init_client_state(train, ctx)
        group = torch.arange(self.num_clients) // self.group_size
        state["members"] = group[ctx.rows].unsqueeze(1) == group.unsqueeze(0)
        return state


def build_job(config: RunConfig, model_name: str, data: FederatedData) -> tuple[Job, Any]:
    """The job of one configuration (inside the run device's scope): P4 with DP on the
    proxy (replace-one), or DP-FedAvg (add-remove), as the runner would build them."""
    model = MODELS[model_name](data.feature_shape, CLASSES)
    if config.method == "p4":
        method: Any = FixedGroupsP4(config, model, config.clients)
        settings = DPSettings(clip=CLIP, noise_multiplier=SIGMA, neighbouring="replace-one")
    else:
        method = FedAvg(config, model, config.clients)
        settings = DPSettings(clip=CLIP, noise_multiplier=SIGMA, neighbouring="add-remove")
    job = Job(config=config, method=method, model=model, data=fresh(data))
    attach_mechanisms(job, settings)
    return job, model


def run_config(
    config: RunConfig, model_name: str, data: FederatedData, device: torch.device
) -> dict[str, Any]:
    """Warm-up, timed and counted rounds of one configuration."""
    clients = config.clients
    timed = TimedNetwork(
        device, count_round=config.rounds - 1, phase=COTRAINING if config.method == "p4" else None
    )
    started = time.perf_counter()
    try:
        with device_scope(device):
            job, model = build_job(config, model_name, data)
            TimedRuntime(timed).execute(job, lambda report: None)
    finally:
        timed.close()
    wall = time.perf_counter() - started
    round_s = statistics.median(timed.seconds[1:])
    flops = timed.flops
    if (
        flops is None
    ):  # the run ended before its counted round: an engine problem, not a measurement
        raise RuntimeError(
            f"the counted round did not run ({len(timed.seconds)} co-training rounds timed)"
        )
    samples = int(data.train.n[0])
    if config.method != "p4":
        path = "dp-sgd"
    elif model_name == "linear":
        path = (
            "span"
            if span_is_cheaper(
                samples, math.prod(data.feature_shape), CLASSES, STEPS, RATE, private=True
            )
            else "buckets"
        )
    else:
        path = "autograd"
    return {
        "round_s": sig(round_s),
        "rounds_s": [sig(t) for t in timed.seconds[1:]],
        "first_round_s": sig(timed.seconds[0]),
        "per_client_ms": sig(round_s / clients * 1000),
        "flops_per_round": flops,
        "tflops": flops / round_s / 1e12,
        "path": path,
        "num_parameters": model.num_parameters(model.init(torch.Generator().manual_seed(0))),
        "config_wall_s": round(wall, 3),
    }


def sig(value: float, digits: int = 6) -> float:
    """`value` to `digits` significant digits (a CPU's TFLOP/s would round to 0 at fixed decimals)."""
    return float(f"{value:.{digits}g}")


def error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:500]


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", default="auto", help="cpu | cuda | cuda:N | auto (default: auto)"
    )
    parser.add_argument(
        "--clients",
        nargs="+",
        default=None,
        help=f"client counts, e.g. 260,2080 or 260 2080 (default: {FULL_CLIENTS} on CUDA, {REDUCED_CLIENTS} elsewhere)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"training samples per client (default: {FULL_SAMPLES} on CUDA, {REDUCED_SAMPLES} elsewhere)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        help=f"models, e.g. linear,scatter-cnn (of {list(MODELS)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed co-training rounds (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--fedavg-clients",
        type=int,
        default=None,
        help=f"clients of the DP-FedAvg round (default: {FULL_FEDAVG} on CUDA, {REDUCED_FEDAVG} elsewhere; 0: none)",
    )
    parser.add_argument(
        "--private-precision",
        nargs="+",
        default=["fp32"],
        help="P4's private-model precisions to time with the scatter-CNN, e.g. fp32 tf32 "
        "(option private_precision: TF32 outside the DP step; no effect on a CPU)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (CI): a few seconds on a CPU"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan of the issue's sizes on a 78 GB "
        "GPU (bench/gpu_plan.py), computed without a GPU, and exit",
    )
    args = parser.parse_args(argv)
    args.models = [m for part in args.models for m in part.split(",") if m]
    args.private_precision = tuple(
        p for part in args.private_precision for p in part.split(",") if p
    )
    if not args.private_precision or set(args.private_precision) - set(PRECISIONS):
        parser.error(f"--private-precision: choose from {list(PRECISIONS)}")
    if unknown := sorted(set(args.models) - set(MODELS)):
        parser.error(f"--models: unknown {unknown}, choose from {list(MODELS)}")
    if args.clients is not None:
        try:
            args.clients = [int(c) for part in args.clients for c in part.split(",") if c]
        except ValueError:
            parser.error(f"--clients must be integers, got {args.clients}")
        if not args.clients or min(args.clients) < 2:
            parser.error("--clients must be at least 2 (P4 groups clients)")
    if (
        args.fedavg_clients is not None
        and args.fedavg_clients not in range(2, 10**8)
        and args.fedavg_clients != 0
    ):
        parser.error("--fedavg-clients must be 0 (none) or at least 2")
    for name in ("samples", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < (
            2 if name == "samples" else 1
        ):
            parser.error(f"--{name} is too small")
    return args


def measure(
    results: list[dict[str, Any]],
    method: str,
    count: int,
    samples: int,
    test: int,
    features: tuple[int, ...],
    models: list[str],
    rounds: int,
    device: torch.device,
    precisions: tuple[str, ...] = ("fp32",),
) -> None:
    """Time every model of `method` at `count` clients (one data set for all), appending
    one entry per model (and, for P4's autograd models, per private-model precision) to
    `results`; a failure is that entry's `error`."""
    try:
        data = synthetic_data(count, samples, test, device, features=features)
    except Exception as exc:  # noqa: BLE001 - out of memory building the data: every model of this size fails
        results += [
            {
                "method": method,
                "model": name,
                "clients": count,
                "error": f"building the data: {error_text(exc)}",
            }
            for name in models
        ]
        release(device)
        return
    for name, precision in [
        (model, precision)
        for model in models
        for precision in (precisions if method == "p4" and model != "linear" else ("fp32",))
    ]:
        options: dict[str, Any] = (
            {"group_size": min(GROUP, count), "samples": min(35, count - 1)}
            if method == "p4"
            else {}
        )
        if precision != "fp32":  # P4's private model in TF32 (p4bench.engine.precision)
            options["private_precision"] = precision
        config = RunConfig(
            method=method,
            model=name,
            clients=count,
            rounds=rounds + 2,
            local_steps=STEPS,
            data_rate=RATE,
            client_rate=1.0,
            lr=0.5,
            noise_multiplier=SIGMA,
            clip=CLIP,
            device=str(device),
            options=options,
        )
        entry: dict[str, Any] = {"method": method, "model": name, "clients": count}
        if method == "p4" and name != "linear":
            entry["private_precision"] = precision
        reset_peak_memory(device)
        try:
            entry.update(run_config(config, name, data, device))
            entry["peak_memory_bytes"] = peak_memory_bytes(device)
        except Exception as exc:  # noqa: BLE001 - reported for this configuration; the others still run
            entry["error"] = error_text(exc)
        results.append(entry)
        release(device)
        status = entry.get("error") or (
            f"{entry['round_s']:.4f} s/round, {entry['per_client_ms']:.3f} ms/client, "
            f"{entry['tflops']:.4f} TFLOP/s"
        )
        tag = f" (private {precision})" if precision != "fp32" else ""
        print(f"{method} {name}{tag} x {count} clients: {status}", flush=True)
    del data
    release(device)


def cli_device(spec: str) -> torch.device | None:
    """`--device SPEC` resolved, or None after one line on stderr (the caller exits 2)."""
    try:
        return resolve_device(spec)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        from gpu_plan import main as plan_main  # bench/gpu_plan.py, beside this file

        return plan_main([])
    device = cli_device(args.device)
    if device is None:
        return 2
    full = device.type == "cuda" and not args.quick
    clients = args.clients or (
        QUICK_CLIENTS if args.quick else FULL_CLIENTS if full else REDUCED_CLIENTS
    )
    samples = args.samples or (
        QUICK_SAMPLES if args.quick else FULL_SAMPLES if full else REDUCED_SAMPLES
    )
    rounds = args.rounds or (1 if args.quick else 3)
    fedavg_clients = (
        args.fedavg_clients
        if args.fedavg_clients is not None
        else (QUICK_FEDAVG if args.quick else FULL_FEDAVG if full else REDUCED_FEDAVG)
    )
    test = max(2, samples // 4)  # evaluated each round, never timed: kept small
    reduced = (
        sorted(clients) != FULL_CLIENTS or samples != FULL_SAMPLES or fedavg_clients != FULL_FEDAVG
    )
    matmul_size = 8192 if device.type == "cuda" else 512 if args.quick else 2048
    matmul_repeats = 10 if device.type == "cuda" else 3 if args.quick else 5
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None

    peak_before = peak_tflops(device, matmul_size, matmul_repeats)
    results: list[dict[str, Any]] = []
    for count in clients:
        measure(
            results,
            "p4",
            count,
            samples,
            test,
            FEATURES,
            args.models,
            rounds,
            device,
            args.private_precision,
        )
    if fedavg_clients:
        measure(
            results,
            "fedavg",
            fedavg_clients,
            FEDAVG_SAMPLES,
            FEDAVG_TEST,
            FEDAVG_FEATURES,
            ["linear"],
            rounds,
            device,
        )
    peak = max(peak_before, peak_tflops(device, matmul_size, matmul_repeats))
    for entry in results:
        if "tflops" in entry:
            entry["fraction_of_peak"] = sig(entry["tflops"] / peak)
            entry["tflops"] = sig(entry["tflops"])
    failed = sum("error" in entry for entry in results)
    out = {
        "benchmark": "gpu",
        "device": describe_device(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "reduced": reduced,
        "reduced_note": (
            f"sizes reduced from the issue's {FULL_CLIENTS} clients x {FULL_SAMPLES} samples "
            f"(those are for GPUs)"
        )
        if reduced
        else None,
        "config": {
            "method": "p4",
            "models": args.models,
            "clients": clients,
            "samples_per_client": samples,
            "test_per_client": test,
            "features": list(FEATURES),
            "classes": CLASSES,
            "local_steps": STEPS,
            "data_rate": RATE,
            "client_rate": 1.0,
            "group_size": GROUP,
            "private_precision": list(args.private_precision),
            "defense": None,
            "grouping": (
                "fixed groups of V consecutive clients; "
                "phase 1 (similarity grouping, cubic memory in M) not run"
            ),
            "dp": {"noise_multiplier": SIGMA, "clip": CLIP, "neighbouring": "replace-one"},
            "fedavg": {
                "clients": fedavg_clients,
                "samples_per_client": FEDAVG_SAMPLES,
                "features": list(FEDAVG_FEATURES),
                "client_rate": 1.0,
                "local_steps": STEPS,
                "data_rate": RATE,
                "dp": {"noise_multiplier": SIGMA, "clip": CLIP, "neighbouring": "add-remove"},
            },
            "noise_generator": noise_generator(RunConfig(device=str(device))),
            "warmup_rounds": 1,
            "timed_rounds": rounds,
            "quick": args.quick,
        },
        "peak_tflops": sig(peak),
        "peak_matmul": {
            "size": matmul_size,
            "dtype": "float32",
            "tf32": tf32,
            "best_of": matmul_repeats,
            "measured": "before and after the configurations, the larger",
        },
        "flops_method": "counted: torch.utils.flop_counter.FlopCounterMode over one co-training round (matmuls and "
        "convolutions, forward and backward, grouped/per-sample weight gradients counted once: "
        "conv_backward_flop; elementwise ops, norms and noise not counted)",
        "peak_memory_kind": (
            "torch.cuda.max_memory_allocated, reset per configuration"
            if device.type == "cuda"
            else "process peak RSS (resource.getrusage): a high-water mark including earlier configurations"
        ),
        "results": results,
        "failed": failed,
    }
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
