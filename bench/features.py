"""Time ScatterNet features: the first request computes them, the second reads the cache.

    python bench/features.py [--count 2000] [--size 28] [--channels 1] [--cache-dir DIR]

Prints one JSON object. Without --cache-dir a temporary folder is used and removed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from p4bench.data.features import FeatureCache, scatter_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()

    images = np.random.default_rng(0).random(
        (args.count, args.channels, args.size, args.size), dtype=np.float32
    )
    with tempfile.TemporaryDirectory() as scratch:
        cache = FeatureCache(args.cache_dir or Path(scratch))
        timings = []
        for _ in range(2):
            started = time.perf_counter()
            out = scatter_features(
                images, cache=cache, batch_size=args.batch_size, device=args.device, progress=False
            )
            timings.append(time.perf_counter() - started)
    print(
        json.dumps(
            {
                "images": args.count,
                "input_shape": [args.channels, args.size, args.size],
                "output_shape": list(out.shape[1:]),
                "device": args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                "torch_threads": torch.get_num_threads(),
                "first_compute_s": round(timings[0], 4),
                "second_cached_s": round(timings[1], 4),
                "speedup": round(timings[0] / max(timings[1], 1e-9), 1),
                "images_per_s_compute": round(args.count / timings[0], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
