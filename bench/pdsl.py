"""Time one PDSL round's compute: the batched implementation vs a per-agent Python loop.

What one PDSL round computes (plugins/p4bench_pdsl/method.py), for M agents on a complete graph
(|M_i| = M, each agent included in its own neighbourhood):

(a) cross-gradients: agent i takes ONE batch B_i of its records and computes
    g_ij = grad F_i(x_j; B_i) for every j in M_i (M * |M_i| gradients);
(b) Shapley: agent i scores the candidates x_i - lr g_ji with Monte-Carlo Shapley values,
    R permutations, a coalition S worth the accuracy on the shared validation set Q of
    x_i - lr mean_{j in S} g_ji (M * R * |M_i| coalition models, each evaluated on Q).

Batched: what PDSL runs, `pdsl_cross_gradients` (on the linear model in closed form: one
product of each agent's batch with its neighbours' stacked weights and one back, the batch
drawn as `cross_gradients` draws it; other models: `cross_gradients`' batched autograd) and
`monte_carlo_shapley` over PDSL's `coalition_game` for all agents at once (keys drawn as
PDSL draws them). Loop: for each agent and neighbour a
plain single-model autograd call; for each agent, permutation and prefix, build the
coalition model and evaluate its accuracy on Q one model at a time (no memoisation, as
Algorithm 2 reads). The loop gets the batches and permutation keys precomputed (its RNG
is not timed); both get the same ones, so the gradients must agree (allclose) and the
Shapley values too (both fed the same received gradients; a coalition's accuracy may
differ by an argmax tie flipped by float rounding, so phi is compared to 1/(|Q| R)).

Workload: digits (sklearn, 8x8 = 64 features, 10 classes), LinearSoftmax (650 params),
M = 20 agents with 90 records each (digits has ~90 per client at M = 20), batch 72
(data_rate 0.8), |Q| = 2000, R = 10, lr 0.5; agents' models are independent inits.
Records are drawn from the digits images with replacement (digits has 1,797 < 20*90 + 2000).
Each timing: one warm-up, then the best of N repetitions, batched and loop interleaved
(the 1-minute load average before/after is reported: on a shared machine, compare only
numbers taken together). Total = the whole batched round (RNG draws included) vs the
loop's two parts. One torch thread by default (both sides on one core). The batched
Shapley values on the linear model (`p4bench_pdsl.shapley_linear`) need no forward
per coalition: one product per label group of Q gives every candidate's margins against
the label, and each order's prefixes are one row of sums that its next player's block is
added to in place (`p4bench_pdsl.shapley_scan`). Timings: best wall and best CPU time
(`*_cpu_s`, `speedup_cpu`: what time slicing on a busy machine does not inflate).
Prints ONE JSON object on stdout (progress on stderr) with the bench convention's thread
count, wall and CPU seconds and peak RSS; `--profile` also prints a torch profile of the
batched round.

    .venv/bin/python bench/pdsl.py [--quick] [--repeats 5] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from p4bench.config import RunConfig
from p4bench.data import ClientTensors
from p4bench.engine.state import unvectorize, vectorize
from p4bench.engine.training import batched_loss_and_grad, fixed_size_batches
from p4bench.models import LinearSoftmax
from p4bench.rng import ClientRng, node_keys
from p4bench_pdsl.cross_linear import pdsl_cross_gradients, takes_linear_path
from p4bench_pdsl.shapley import coalition_game, linear_in_parameters, monte_carlo_shapley

M, PER_AGENT, DATA_RATE, Q_SIZE, R, LR, CLASSES = 20, 90, 0.8, 2000, 10, 0.5, 10


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workload(seed: int = 0) -> SimpleNamespace:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy((bunch.images.astype(np.float32) / 16.0)[:, None])  # (N, 1, 8, 8)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(labels), (M * PER_AGENT + Q_SIZE,), generator=gen)
    train_idx, q_idx = pick[: M * PER_AGENT].view(M, PER_AGENT), pick[M * PER_AGENT :]
    train = ClientTensors(images[train_idx], labels[train_idx], torch.full((M,), PER_AGENT))
    model = LinearSoftmax((1, 8, 8), CLASSES)
    inits = [model.init(torch.Generator().manual_seed(seed * 1000 + i)) for i in range(M)]
    params = {k: torch.stack([p[k] for p in inits]) for k in inits[0]}  # (M, ...): agent i's x_i
    x = vectorize(params)  # (M, P)
    models = x.unsqueeze(0).expand(M, M, -1).contiguous()  # slot j of row i: x_j (complete graph)
    present = torch.ones(M, M, dtype=torch.bool)
    keys = node_keys(seed, torch.arange(M))
    return SimpleNamespace(
        train=train,
        model=model,
        params=params,
        x=x,
        models=models,
        present=present,
        keys=keys,
        q_x=images[q_idx],
        q_y=labels[q_idx],
    )


def make_ctx(w: SimpleNamespace) -> SimpleNamespace:
    """The attributes `cross_gradients` reads, fresh RNG streams each time."""
    return SimpleNamespace(
        dp=None,
        rng=ClientRng(w.keys),
        config=RunConfig(data_rate=DATA_RATE),
        model=w.model,
        loss_and_grad=partial(batched_loss_and_grad, w.model),
    )


# -- batched (what PDSL runs) --------------------------------------------------------------------
def batched_cross(w: SimpleNamespace, ctx: SimpleNamespace) -> torch.Tensor:
    grads, _, _ = pdsl_cross_gradients(ctx, w.models, w.params, w.present, w.train, "batch")
    return grads  # (M, K, P): grads[i, j] = g_ij = grad F_i(x_j; B_i)


def batched_shapley(w: SimpleNamespace, ctx: SimpleNamespace, grads: torch.Tensor) -> torch.Tensor:
    received = grads.transpose(0, 1)  # received[i, j] = g_ji: x_i's gradient on j's batch
    keys = ctx.rng.uniform(R * M).view(M, -1, M)  # as PDSL._shapley_step draws them

    values = coalition_game(w.model, w.params, w.x, received, LR, w.q_x, w.q_y)
    return monte_carlo_shapley(values, w.present, R, keys=keys)


def batched_round(w: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = make_ctx(w)
    grads = batched_cross(w, ctx)
    return grads, batched_shapley(w, ctx, grads)


# -- per-agent loop (a straightforward implementation) ------------------------------------------
def draws(w: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches and permutation keys the batched path draws (same streams, same order)."""
    ctx = make_ctx(w)
    index, _ = fixed_size_batches(ctx, w.train)
    return index, ctx.rng.uniform(R * M).view(M, R, M)


def single(w: SimpleNamespace, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[0] for k, v in unvectorize(vector.unsqueeze(0), w.params).items()}


def loop_cross(w: SimpleNamespace, index: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(w.models)
    for i in range(M):
        xb, yb = w.train.x[i, index[i]], w.train.y[i, index[i]]
        for j in range(M):
            params = {k: v.clone().requires_grad_(True) for k, v in single(w, w.x[j]).items()}
            loss = F.cross_entropy(w.model.forward(params, xb), yb)
            names = sorted(params)
            grads = torch.autograd.grad(loss, [params[k] for k in names])
            out[i, j] = torch.cat([g.flatten() for g in grads])
    return out


@torch.no_grad()
def loop_shapley(w: SimpleNamespace, grads: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    received = grads.transpose(0, 1)
    phi = torch.zeros(M, M, dtype=torch.float64)
    for i in range(M):
        for r in range(R):
            order = keys[i, r].argsort().tolist()
            previous = 0.0  # v(empty) = 0
            for length in range(1, M + 1):
                members = order[:length]
                candidate = w.x[i] - LR * received[i, members].mean(dim=0)
                logits = w.model.forward(single(w, candidate), w.q_x)
                value = (logits.argmax(dim=1) == w.q_y).double().mean().item()
                phi[i, order[length - 1]] += value - previous
                previous = value
    return phi / R


# -- timing ------------------------------------------------------------------------------------
def best_of(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """One warm-up of each, then `repeats` rounds that run each once, interleaved (so a
    load change on a shared machine hits batched and loop alike); the best wall time of
    each, and the best CPU time (this process's: what a busy machine's time slicing does
    not inflate, though its shared caches still can)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    best_cpu = dict(best)
    for rep in range(repeats):
        for name, fn in fns.items():
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
            best_cpu[name] = min(best_cpu[name], time.process_time() - cpu)
        log(
            f"  repetition {rep + 1}/{repeats}: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items())
        )
    return best, best_cpu


def profile(w: SimpleNamespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batched_round(w)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        batched_round(w)
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (best of 2)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repetitions (default 5, --quick 2)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print a torch profile of the batched round on stderr",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: both sides on one core)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    repeats = args.repeats or (2 if args.quick else 5)
    w = workload()

    log("checking batched vs loop ...")
    index, keys = draws(w)
    grads_b, phi_b = batched_round(w)
    grads_l = loop_cross(w, index)
    phi_l = loop_shapley(
        w, grads_b, keys
    )  # same received gradients: phi compared on the Shapley part alone
    grad_err = float((grads_b - grads_l).abs().max())
    phi_err = float((phi_b - phi_l).abs().max())
    grads_match = bool(torch.allclose(grads_b, grads_l, rtol=1e-4, atol=1e-6))
    phi_match = bool(torch.allclose(phi_b, phi_l, rtol=0, atol=1.0 / (Q_SIZE * R) + 1e-12))

    log(f"timing (warm-up + best of {repeats}, interleaved) ...")
    load_before = os.getloadavg()[0]
    ctx = make_ctx(w)
    best, cpu = best_of(
        {
            "cross_b": lambda: batched_cross(w, ctx),
            "shapley_b": lambda: batched_shapley(w, ctx, grads_b),
            "round_b": lambda: batched_round(w),
            "cross_l": lambda: loop_cross(w, index),
            "shapley_l": lambda: loop_shapley(w, grads_b, keys),
        },
        repeats,
    )
    if args.profile:
        profile(w)

    def pair(batched: str, loop: tuple[str, ...]) -> dict[str, float]:
        wall_b, wall_l = best[batched], sum(best[name] for name in loop)
        cpu_b, cpu_l = cpu[batched], sum(cpu[name] for name in loop)
        return {
            "batched_s": round(wall_b, 6),
            "loop_s": round(wall_l, 6),
            "speedup": round(wall_l / wall_b, 2),
            "batched_cpu_s": round(cpu_b, 6),
            "loop_cpu_s": round(cpu_l, 6),
            "speedup_cpu": round(cpu_l / cpu_b, 2),
        }

    # the loop's parts run one after the other, nothing shared
    total = pair("round_b", ("cross_l", "shapley_l"))
    print(
        json.dumps(
            {
                "benchmark": "pdsl_round",
                "M": M,
                "M_i": M,
                "params": int(w.x.shape[1]),
                "records_per_agent": PER_AGENT,
                "batch": int(round(DATA_RATE * PER_AGENT)),
                "Q": Q_SIZE,
                "R": R,
                "model": "linear (LinearSoftmax, 64 -> 10)",
                "data": "sklearn digits, resampled",
                "dp": None,
                "cross_gradients_per_round": M * M,
                "coalition_models_per_round_loop": M * R * M,
                "cross_gradients": pair("cross_b", ("cross_l",)),
                "shapley": pair("shapley_b", ("shapley_l",)),
                "total": total,
                "repeats": repeats,
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "cpu_count": os.cpu_count(),
                "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "check": {
                    "grads_allclose": grads_match,
                    "grads_max_abs_diff": grad_err,
                    "phi_match": phi_match,
                    "phi_max_abs_diff": phi_err,
                    "phi_tolerance": 1.0 / (Q_SIZE * R),
                    "phi_spread_mean": float((phi_b.max(1).values - phi_b.min(1).values).mean()),
                },
                "target_speedup": 20,
                "meets_target": bool(total["speedup"] >= 20),
                "cross_gradient_path": "closed form (linear model)"
                if takes_linear_path(make_ctx(w), "batch")
                else "cross_gradients (autograd)",
                "shapley_path": "linear logits"
                if linear_in_parameters(w.model)
                else "forward per coalition",
                "wall_s": round(time.perf_counter() - started, 2),
                "cpu_s": round(time.process_time() - cpu_started, 2),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                # The loop's coalition forwards are (|Q| x d) @ (d x C) products big enough for BLAS:
                # its arithmetic rate shows how much of its time is Python overhead (little) vs work.
                "loop_shapley_gflop_per_s": round(
                    2 * M * R * M * Q_SIZE * int(w.x.shape[1]) / best["shapley_l"] / 1e9, 2
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
