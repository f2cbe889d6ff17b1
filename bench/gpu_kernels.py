"""The pieces of one stacked scatter-CNN step (p4bench.models.stacked) at bench/gpu.py's shapes,
timed one by one: where a step's time goes, and what the alternatives would cost.

Per piece (median of `--repeats` after a warm-up, device synchronised around each):
the first convolution's input patches (`F.unfold`, one kernel per sample on CUDA, and
`p4bench.models.stacked`'s strided view and copy), its forward GEMM, the ghost norm's Gram
GEMM, the clipped sum's GEMM, the same convolution by cuDNN as a grouped convolution
(one group per client), each GEMM also with TF32; then the three calls a P4 step makes
(`clipped_gradient_sum`, `stacked_logits`, `stacked_loss_and_grad`) on all clients, and
the 15 device kernels with the most time in one `clipped_gradient_sum`. The last line of
stdout is one JSON object.

    python bench/gpu_kernels.py [--device cuda] [--clients 260] [--batch 99] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu import cli_device  # bench/gpu.py, beside this script

from p4bench.engine.devices import device_scope, synchronize
from p4bench.engine.training import cross_entropy
from p4bench.models import ScatterCNN, stacked

FEATURES, CLASSES = (243, 8, 8), 10


def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--clients", type=int, default=260)
    parser.add_argument(
        "--batch",
        type=int,
        default=99,
        help="realised batch width (Poisson at s = 0.5 of 160: about 99)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = cli_device(args.device)
    if device is None:
        return 2
    model = ScatterCNN(FEATURES, CLASSES)
    out: dict[str, object] = {
        "benchmark": "gpu_kernels",
        "device": str(device),
        "clients": args.clients,
        "batch": args.batch,
    }
    pieces: dict[str, float] = {}
    base = model.init(torch.Generator().manual_seed(0))  # drawn on the host, as runs do
    with device_scope(device):
        params = {k: v.to(device).expand(args.clients, *v.shape).clone() for k, v in base.items()}
        x = torch.randn(args.clients, args.batch, *FEATURES)
        y = torch.randint(0, CLASSES, (args.clients, args.batch))
        mask = torch.ones(args.clients, args.batch)
        chunk = max(1, min(args.clients, stacked.CHUNK_ELEMENTS // model.stacked_rows(x[:1])))
        out["chunk_clients"] = chunk
        part = slice(0, chunk)
        h = F.group_norm(x[part].reshape(-1, *FEATURES), 27).view(chunk, args.batch, *FEATURES)
        unfolded = F.unfold(h.reshape(-1, *FEATURES), 3, padding=1)
        rows = unfolded.transpose(1, 2).reshape(chunk, -1, unfolded.shape[1])
        weight = params["conv1.weight"][part].reshape(chunk, 64, -1)
        grads = torch.randn(chunk, rows.shape[1], 64)
        per = rows.view(chunk * args.batch, 64, -1)
        flops = {
            "forward": 2 * rows.shape[0] * rows.shape[1] * rows.shape[2] * 64,
            "gram": 2 * per.shape[0] * 64 * 64 * per.shape[2],
        }
        flops["sum"] = flops["forward"]
        pieces["F.unfold_and_rows"] = timed(
            device,
            lambda: (
                F.unfold(h.reshape(-1, *FEATURES), 3, padding=1)
                .transpose(1, 2)
                .reshape(chunk, -1, unfolded.shape[1])
            ),
            args.repeats,
        )
        pieces["patch_rows"] = timed(
            device, lambda: stacked._patch_rows(h.reshape(-1, *FEATURES), 3, 1, 1), args.repeats
        )
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            suffix = "_tf32" if tf32 else ""
            pieces["forward" + suffix] = timed(
                device, lambda: torch.bmm(rows, weight.transpose(1, 2)), args.repeats
            )
            pieces["gram" + suffix] = timed(
                device, lambda: torch.bmm(per, per.transpose(1, 2)), args.repeats
            )
            pieces["sum" + suffix] = timed(
                device, lambda: torch.bmm(grads.transpose(1, 2), rows), args.repeats
            )
        torch.backends.cuda.matmul.allow_tf32 = False
        grouped = params["conv1.weight"][part].reshape(chunk * 64, 243, 3, 3)
        side = h.transpose(0, 1).reshape(args.batch, chunk * 243, 8, 8)
        for tf32 in (False, True):
            torch.backends.cudnn.allow_tf32 = tf32
            pieces["cudnn_grouped_forward" + ("_tf32" if tf32 else "")] = timed(
                device, lambda: F.conv2d(side, grouped, padding=1, groups=chunk), args.repeats
            )
        torch.backends.cudnn.allow_tf32 = True
        out["chunk_tflops"] = {
            k: flops[k.removesuffix("_tf32")] / v / 1e12
            for k, v in pieces.items()
            if k.removesuffix("_tf32") in flops
        }
        calls = {
            "clipped_gradient_sum": lambda: stacked.clipped_gradient_sum(
                model, params, x, y, mask, 1.0, cross_entropy
            ),
            "stacked_logits": lambda: stacked.stacked_logits(model, params, x),
            "stacked_loss_and_grad": lambda: stacked.stacked_loss_and_grad(
                model, params, x, y, mask, cross_entropy
            ),
        }
        for name, call in calls.items():
            pieces[name] = timed(device, call, max(1, args.repeats // 2))
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                calls["clipped_gradient_sum"]()
                synchronize(device)
            events = prof.key_averages()
            out["top_device_kernels"] = [
                (e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3))
                for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]
            ]
            out["launches"] = sum(e.count for e in events if e.key == "cudaLaunchKernel")
    out["seconds"] = {k: round(v, 6) for k, v in pieces.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
