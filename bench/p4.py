"""P4 phase-2 round time on a CIFAR-10-shaped workload, against the machine's limits.

Workload (issue 5): 260 clients, 160 training samples each, 243x8x8 ScatterNet-shaped
features (synthetic), linear models, K = 5 local steps, s = 0.5, groups of 8, DP on
(sigma = 1, C = 1, replace-one), every member trains each round (l = 1).

Reported next to the measured round time:
- the machine's GEMM throughput, measured in this run (best of 7 square 2048 products,
  before and after the rounds: its peak, so the bound below is the strictest one);
- the FLOP lower bound of one round as issue 5 defines it: per client and step, the
  forward and the weight gradient of both models (8 * b * d * L FLOPs with b = s * n
  expected batch), divided by that throughput;
- `path`, the fused step P4 picks here (the span path, see plugins/p4bench_p4/span.py), the
  FLOPs it really executes (fewer than the bound above counts: two GEMMs over all n
  samples instead of 2K over s n) and the round time against those
  (`executed_bound_ratio`), so the headline ratio is not flattered by doing less work;
- the chosen path's GEMMs alone at the workload's own shapes, timed with the same BLAS:
  what it achieves for these skinny products, the floor of any implementation built on it;
- the first round apart (`first_round_s`): it also factors each client's Gram matrix
  (the implicit orthonormal basis, `p4bench.privacy.span_factor`), once per dataset;
  `round_s` is the median of the later rounds;
- memory: `peak_rss_mb` beside `floor_mb`, what the workload needs (the interpreter before
  any data, plus the samples and three linear models per client, computed from their
  sizes) and `peak_over_floor_mb`, the difference;
- a per-client loop as research code writes it (torch modules, opacus GradSampleModule
  per-sample gradients, clipping and noise by hand), timed on a subset of clients and
  scaled to all of them.
The last line of stdout is one JSON object.

    python bench/p4.py [--clients 260] [--rounds 5] [--loop-clients 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from typing import Any

import numpy as np
import torch

from p4bench.config import RunConfig
from p4bench.data import ClientTensors, FederatedData
from p4bench.engine import Job
from p4bench.engine.memory import keep_freed_memory
from p4bench.engine.runtime import SimulationRuntime
from p4bench.models import LinearSoftmax
from p4bench.privacy.groups import attach_mechanisms
from p4bench.privacy.mechanism import DPSettings
from p4bench_p4.method import P4
from p4bench_p4.span import span_is_cheaper

FEATURES, CLASSES, TRAIN, TEST = (243, 8, 8), 10, 160, 40
LAST_ROUND_CPU_S = math.nan  # set by `engine_round`: median CPU seconds of the later rounds
GEMM_GFLOPS_PER_CPU_S = 0.0  # set by `gemm_gflops`: the best GEMM rate per CPU-second


def synthetic_data(clients: int, seed: int = 0) -> FederatedData:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, *FEATURES, generator=gen)

    def split(count: int) -> ClientTensors:
        y = torch.randint(0, CLASSES, (clients, count), generator=gen)
        x = torch.randn(clients, count, *FEATURES, generator=gen)
        for start in range(
            0, clients, 16
        ):  # class centres added in place: no second copy of the data
            x[start : start + 16].add_(centers[y[start : start + 16]], alpha=0.3)
        return ClientTensors(x, y, torch.full((clients,), count))

    return FederatedData(
        split(TRAIN),
        split(TEST),
        torch.zeros(clients, dtype=torch.bool),
        CLASSES,
        FEATURES,
        tuple(map(str, range(CLASSES))),
        tuple(),
    )


def gemm_gflops(size: int = 2048, repeats: int = 7) -> float:
    """The machine's peak GEMM rate: best of `repeats` square products (the strictest bound).
    Also keeps the best rate per CPU-second (`GEMM_GFLOPS_PER_CPU_S`), which other work on
    the cores does not lower as much as the wall-clock rate."""
    global GEMM_GFLOPS_PER_CPU_S
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best, best_cpu = math.inf, math.inf
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        a @ b
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu_start)
    GEMM_GFLOPS_PER_CPU_S = max(GEMM_GFLOPS_PER_CPU_S, 2 * size**3 / max(best_cpu, 1e-9) / 1e9)
    return 2 * size**3 / best / 1e9


def workload_gemm_s(clients: int, data: FederatedData, repeats: int = 3) -> float:
    """Seconds of one round's GEMMs alone, at the shapes of the path P4 picks for this
    workload (best of `repeats`): the span path's [W_proxy; W_private; G] X^T and
    W - B X against each client's own samples (the orthonormal basis is applied
    implicitly, `p4bench.privacy.span_factor`: no stored basis), or the bucketed path's
    per-step W X^T and W -= G^T X on s n rows."""
    d, n, steps = math.prod(FEATURES), TRAIN, 5
    best = math.inf
    if span_is_cheaper(n, d, CLASSES, steps, 0.5, private=True):
        samples = data.train.x.flatten(start_dim=2)  # a view: the run's own data, no copy
        stacked, coefficients = (
            torch.randn(clients, 3 * CLASSES, d),
            torch.randn(clients, 2 * CLASSES, n),
        )
        out = torch.empty(clients, 2 * CLASSES, d)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.bmm(stacked, samples.transpose(1, 2))
            torch.baddbmm(stacked[:, : 2 * CLASSES], coefficients, samples, alpha=-1.0, out=out)
            best = min(best, time.perf_counter() - start)
        return best
    rows = int(0.5 * n)
    x, w = torch.randn(clients, rows, d), torch.randn(clients, 2 * CLASSES, d)
    g = torch.randn(clients, 2 * CLASSES, rows)
    for _ in range(repeats):
        start = time.perf_counter()
        torch.bmm(w, x.transpose(1, 2))
        w.baddbmm_(g, x, alpha=-1e-9)
        best = min(best, time.perf_counter() - start)
    return best * steps


def floor_bytes(clients: int) -> dict[str, int]:
    """What the workload itself needs, from its sizes: every client's float32 samples,
    int64 labels and counts (train and test), and three linear models per client (proxy,
    private and the group's proxy: weights and biases, float32)."""
    d = math.prod(FEATURES)
    samples = clients * (TRAIN + TEST) * (d * 4 + 8) + 2 * clients * 8
    models = 3 * clients * (CLASSES * d + CLASSES) * 4
    return {"data": samples, "models": models}


def current_rss_mb() -> float:
    """This process's resident memory now (not its peak), from /proc."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def executed_flops(clients: int) -> float:
    """FLOPs the chosen path performs in one round (the bound above counts 8 b d L K per
    client, the work of a per-step implementation; the span path does less): the two
    GEMMs against the basis (3L and 2L rows), the n-space products of the K steps, and
    the small products between basis and sample coordinates."""
    d, n, steps, L = math.prod(FEATURES), TRAIN, 5, CLASSES
    if span_is_cheaper(n, d, L, steps, 0.5, private=True):
        m = min(n, d)
        return clients * (
            2 * m * d * 5 * L
            + steps * 4 * L * n * n
            + 2 * m * n * (4 * L + (steps - 1) * L)
            + 2 * m * m * n
        )  # the implicit basis's two triangular solves (L rows each) are in the last term's order
    return clients * 8 * (0.5 * n) * d * L * steps


def engine_round(
    clients: int, rounds: int, data: FederatedData, aggregator_check: str = "recompute"
) -> tuple[float, list[float]]:
    config = RunConfig(
        method="p4",
        clients=clients,
        rounds=rounds,
        local_steps=5,
        data_rate=0.5,
        client_rate=1.0,
        lr=0.5,
        noise_multiplier=1.0,
        options={"group_size": 8, "samples": 35, "aggregator_check": aggregator_check},
    )
    model = LinearSoftmax(FEATURES, CLASSES)
    job = Job(config=config, method=P4(config, model, clients), model=model, data=data)
    attach_mechanisms(job, DPSettings(clip=1.0, noise_multiplier=1.0, neighbouring="replace-one"))
    times: list[float] = []
    cpu_marks: list[float] = []

    def record(report: Any) -> None:
        if report.phase == "cotraining":
            times.append(report.seconds)
            cpu_marks.append(time.process_time())

    SimulationRuntime().execute(job, record)
    # CPU seconds between the ends of consecutive co-training rounds (both threads' time):
    # what the later rounds cost whatever else shares the cores
    global LAST_ROUND_CPU_S
    deltas = np.diff(cpu_marks)
    LAST_ROUND_CPU_S = float(np.median(deltas)) if len(deltas) else math.nan
    return float(np.median(times[1:] if len(times) > 1 else times)), times


def loop_round(data: FederatedData, clients: int) -> float:
    """One phase-2 round for `clients` clients, one at a time, opacus per-sample gradients."""
    from opacus import GradSampleModule

    d = math.prod(FEATURES)
    start = time.perf_counter()
    for c in range(clients):
        proxy = GradSampleModule(torch.nn.Linear(d, CLASSES))
        private = torch.nn.Linear(d, CLASSES)
        opt_private = torch.optim.SGD(private.parameters(), lr=0.5)
        x_all, y_all = data.train.x[c].reshape(TRAIN, d), data.train.y[c]
        for _ in range(5):
            chosen = torch.rand(TRAIN) < 0.5  # Poisson sampling
            x, y = x_all[chosen], y_all[chosen]
            proxy_logits, private_logits = proxy(x), private(x)
            kl = torch.nn.functional.kl_div
            loss = 0.5 * torch.nn.functional.cross_entropy(proxy_logits, y) + 0.5 * kl(
                torch.log_softmax(proxy_logits, -1),
                torch.log_softmax(private_logits.detach(), -1),
                log_target=True,
                reduction="batchmean",
            )
            proxy.zero_grad()
            loss.backward()
            samples = torch.cat(
                [p.grad_sample.reshape(len(y), -1) for p in proxy.parameters()], dim=1
            )
            scale = (1.0 / samples.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
            clipped = (samples * scale[:, None]).sum(0)
            noisy = (clipped + torch.randn_like(clipped) * 2.0) / (0.5 * TRAIN)
            with torch.no_grad():
                offset = 0
                for p in proxy.parameters():
                    p -= 0.5 * noisy[offset : offset + p.numel()].reshape(p.shape)
                    offset += p.numel()
            private_loss = 0.5 * torch.nn.functional.cross_entropy(private(x), y) + 0.5 * kl(
                torch.log_softmax(private(x), -1),
                torch.log_softmax(proxy_logits.detach(), -1),
                log_target=True,
                reduction="batchmean",
            )
            opt_private.zero_grad()
            private_loss.backward()
            opt_private.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=260)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop-clients", type=int, default=8)
    parser.add_argument(
        "--aggregator-check",
        choices=("recompute", "turn", "none"),
        default="recompute",
        help="P4's check of its aggregators (the run's default); none: the paper's protocol",
    )
    args = parser.parse_args()
    keep_freed_memory()  # what the runtime does anyway; here it also speeds up building the data
    interpreter_mb = current_rss_mb()  # the interpreter with torch loaded, before any data
    started, cpu_started, load_before = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    data = synthetic_data(args.clients)
    before = gemm_gflops()
    round_s, all_rounds = engine_round(args.clients, args.rounds, data, args.aggregator_check)
    gflops = max(
        before, gemm_gflops()
    )  # before and after: a busy moment on a shared machine must not loosen the bound
    d = math.prod(FEATURES)
    flops = 8 * (0.5 * TRAIN) * d * CLASSES * 5 * args.clients
    bound_s = flops / (gflops * 1e9)
    shapes_s = workload_gemm_s(args.clients, data)
    executed = executed_flops(args.clients)
    loop_s = loop_round(data, args.loop_clients) * args.clients / args.loop_clients
    print(
        f"phase-2 round {round_s:.3f} s (rounds: {[round(t, 3) for t in all_rounds]}); GEMM {gflops:.1f} GFLOP/s; "
        f"FLOP bound {bound_s:.3f} s; the round's GEMMs alone {shapes_s:.3f} s; "
        f"per-client opacus loop {loop_s:.2f} s (scaled from {args.loop_clients} clients)"
    )
    print(
        json.dumps(
            {
                "benchmark": "p4",
                "clients": args.clients,
                "aggregator_check": args.aggregator_check,
                "train_per_client": TRAIN,
                "features": list(FEATURES),
                "local_steps": 5,
                "data_rate": 0.5,
                "group_size": 8,
                "torch_threads": torch.get_num_threads(),
                "round_s": round(round_s, 4),
                "gemm_gflops": round(gflops, 2),
                "round_gflop": round(flops / 1e9, 2),
                "flop_bound_s": round(bound_s, 4),
                "bound_ratio": round(round_s / bound_s, 3),
                # the same in CPU time: the round's CPU seconds (all threads) against the
                # bound's FLOPs at the GEMM's best rate per CPU-second; less sensitive to
                # other work on the cores than the wall-clock ratio above
                "round_cpu_s": round(LAST_ROUND_CPU_S, 4),
                "gemm_gflops_per_cpu_s": round(GEMM_GFLOPS_PER_CPU_S, 2),
                "cpu_bound_ratio": round(LAST_ROUND_CPU_S * GEMM_GFLOPS_PER_CPU_S * 1e9 / flops, 3),
                "path": "span"
                if span_is_cheaper(TRAIN, d, CLASSES, 5, 0.5, private=True)
                else "buckets",
                "executed_gflop": round(executed / 1e9, 2),
                "executed_bound_ratio": round(round_s * gflops * 1e9 / executed, 3),
                "first_round_s": round(
                    all_rounds[0], 4
                ),  # includes the basis factors, computed once per dataset
                "workload_gemm_s": round(shapes_s, 4),
                "workload_gemm_share": round(shapes_s / round_s, 3),
                "loop_round_s": round(loop_s, 3),
                "speedup_vs_loop": round(loop_s / round_s, 2),
                **machine_load(load_before, torch.get_num_threads()),
                "wall_s": round(time.perf_counter() - started, 1),
                "cpu_s": round(time.process_time() - cpu_started, 1),
                **memory_figures(interpreter_mb, floor_bytes(args.clients)),
            }
        )
    )


def memory_figures(interpreter_mb: float, floor: dict[str, int]) -> dict[str, float]:
    """Peak RSS against the floor: the interpreter as it stood before the data, plus what
    the workload's data and models need (`floor_bytes`, computed, not measured)."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    floor_mb = interpreter_mb + sum(floor.values()) / 2**20
    return {
        "interpreter_mb": round(interpreter_mb, 1),
        "data_mb": round(floor["data"] / 2**20, 1),
        "models_mb": round(floor["models"] / 2**20, 1),
        "floor_mb": round(floor_mb, 1),
        "peak_rss_mb": round(peak_mb, 1),
        "peak_over_floor_mb": round(peak_mb - floor_mb, 1),
    }


def machine_load(before: float, threads: int) -> dict:
    """The 1-minute load before and after the run, and a note when other work shared the
    cores: the bound ratios above assume the run had its threads to itself (on a quiet
    2-core machine 1.6; under a load of 9 the same code measured 4.1)."""
    after = os.getloadavg()[0]
    busy = max(before, after) > threads + 1  # this run's own threads count in the load
    return {
        "load_1min_before": round(before, 2),
        "load_1min_after": round(after, 2),
        "note": f"busy machine (load {max(before, after):.1f} on {threads} threads): the ratios are not comparable"
        if busy
        else "quiet machine: the ratios are this machine's",
    }


if __name__ == "__main__":
    main()
