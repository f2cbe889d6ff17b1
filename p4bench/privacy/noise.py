"""Per-node Gaussian noise streams for the DP mechanism."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from p4bench.rng import ClientRng, SecretSource, node_keys

# Seeded noise: `torch` (a CPU generator per node, the default on the CPU) or `philox`
# (the per-node counter-based streams of p4bench.rng: identical numbers on every device,
# batched over nodes; the default on accelerators).
NOISE_GENERATORS = ("torch", "philox")
PURPOSE_NOISE, TAG_NOISE = 3, 0x4E4F

_PHILOX_CHUNK = 1 << 25  # normals per batch of rows of a Philox draw (1.3 GB of temporaries)
_PARALLEL_MIN = 1 << 22  # draws below ~4M normals: threads cost more than they save
_pool: tuple[int, ThreadPoolExecutor] | None = (
    None  # (owner pid, pool): a forked child needs its own
)


def _workers() -> int:
    return max(1, torch.get_num_threads())


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(_workers(), thread_name_prefix="p4bench-noise"))
    return _pool[1]


class NoiseStreams:
    """Independent Gaussian noise per node.

    Seeded mode (simulation): one torch generator per node, seeded from (run seed, node
    id) through numpy's SeedSequence: reproducible, independent across nodes, never
    derived from public round or step numbers, but not secret: anyone holding the run
    config can recompute every node's noise. Secure mode (separate parties, devices):
    every draw comes from a `SecretSource` (a keystream under a key from the OS CSPRNG),
    nothing derives from the seed, and runs are not reproducible.

    Large draws fill rows on several threads (torch's sampler is single-threaded and
    releases the GIL); each row still consumes only its own node's stream, so the
    numbers do not depend on the thread count.
    """

    _parent: NoiseStreams | None = None  # set by `take`: the streams this one was taken from
    _positions: torch.Tensor  # ... and its rows there

    def __init__(
        self, seed: int, node_ids: list[int], secure: bool = False, generator: str = "torch"
    ) -> None:
        if generator not in NOISE_GENERATORS:
            raise ValueError(
                f"noise generator must be one of {', '.join(NOISE_GENERATORS)}, got {generator!r}"
            )
        self.secure = secure
        self._ids: list[int] | None = list(node_ids)
        self._lazy_ids: tuple[NoiseStreams, torch.Tensor] | None = None
        self.count = len(self._ids)
        self.source = SecretSource() if secure else None
        self.philox = (
            ClientRng(node_keys(seed, self.node_ids, PURPOSE_NOISE))
            if generator == "philox" and not secure
            else None
        )
        self.generators: list[torch.Generator | None] = [
            None
            if secure or self.philox is not None
            else torch.Generator().manual_seed(
                int(np.random.SeedSequence([seed, 1, i + 1]).generate_state(1, np.uint64)[0] >> 1)
            )
            for i in self.node_ids
        ]
        self._scratch: dict[str, torch.Tensor] = {}  # shared with the streams `take` hands out

    def _buffer(self, rows: int, size: int) -> torch.Tensor:
        scratch = self._scratch.get("noise")
        if (
            scratch is None
            or scratch.numel() < rows * size
            or scratch.device != torch.get_default_device()
        ):
            scratch = torch.empty(rows * size)
            self._scratch["noise"] = scratch
        return scratch[: rows * size].view(rows, size)

    @property
    def node_ids(self) -> list[int]:
        """The node id of every row (read back from the device on first use, for sub-streams
        of the Philox or secret streams, which never need them to draw)."""
        if self._ids is None:
            assert self._lazy_ids is not None
            parent, positions = self._lazy_ids
            ids = parent.node_ids
            self._ids, self._lazy_ids = [ids[p] for p in positions.tolist()], None
        return self._ids

    @node_ids.setter
    def node_ids(self, ids: list[int]) -> None:
        self._ids, self._lazy_ids, self.count = list(ids), None, len(ids)

    def take(self, positions: torch.Tensor) -> NoiseStreams:
        """The streams of some rows, in the order of `positions` (shares the generators,
        so draws advance them)."""
        sub = NoiseStreams.__new__(NoiseStreams)
        sub.secure, sub.source = self.secure, self.source
        if self.philox is None and not self.secure:  # torch's generators are picked on the host
            picked = positions.tolist()
            sub.node_ids = [self.node_ids[p] for p in picked]
            sub.generators = [self.generators[p] for p in picked]
        else:  # the Philox streams and the keystream need no read back (on a GPU, a synchronisation):
            sub._ids, sub._lazy_ids = None, (self, positions)  # ids resolved only if asked for
            sub.generators = [None] * len(positions)
        sub.count = len(positions)
        sub.philox = self.philox.take(positions) if self.philox is not None else None
        sub._parent, sub._positions = (
            self,
            positions,
        )  # a philox sub-stream writes its counters back
        sub._scratch = self._scratch
        return sub

    def normal(self, size: int) -> torch.Tensor:
        """(rows, size) float32 standard normals, row i from node i's stream.

        The result lives in a buffer reused by the next call (large fresh allocations
        cost more in page faults than the sampling itself): use it before drawing again.
        """
        (out,) = self.normal_parts([(size,)])
        return out

    def normal_parts(self, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """One (rows, *shape) tensor of standard normals per shape, drawn as `fill` does,
        in one scratch buffer reused by the next call: use them before drawing again."""
        sizes = [math.prod(shape) for shape in shapes]
        scratch = self._buffer(self.count, sum(sizes))
        parts, offset = [], 0
        for shape, size in zip(shapes, sizes):
            parts.append(scratch[:, offset : offset + size].view(self.count, *shape))
            offset += size
        self.fill(parts)
        return parts

    def fill(self, parts: Sequence[torch.Tensor]) -> None:
        """Overwrite each part (rows, ...) with standard normals: row i of every part from
        node i's stream, the parts in the given order, one C-level fill each.

        So a release drawn as parts [bias, weight] and K releases drawn at once as
        [bias_0, weight_0, ..., bias_K-1, weight_K-1] consume every stream identically.
        Each part's rows must be contiguous (`part[i]` is filled in memory order).
        """
        count = self.count
        if any(len(part) != count or not part[0].is_contiguous() for part in parts if part.numel()):
            raise ValueError("noise parts need one contiguous block per stream")
        if self.secure:  # one batched draw for every part and row
            assert self.source is not None  # set when secure
            sizes = [math.prod(part.shape[1:]) for part in parts]
            normal = _secret_normal(self.source, count * sum(sizes)).view(count, sum(sizes))
            device = parts[0].device if parts else normal.device
            if device != normal.device:  # keystream drawn on the host: one copy to the run's device
                dtypes = {part.dtype for part in parts}
                normal = (normal.to(dtypes.pop()) if len(dtypes) == 1 else normal).to(device)
            offset = 0
            for part, size in zip(parts, sizes):
                part.copy_(normal[:, offset : offset + size].reshape(part.shape))
                offset += size
            return

        if (
            self.philox is not None
        ):  # counter-based: batched draws, the same numbers on every device
            sizes = [math.prod(part.shape[1:]) for part in parts]
            total = sum(sizes)
            # rows at a time, so the temporaries (words, float64) stay bounded whatever the
            # clients; a row's numbers do not depend on the others: the same draws as at once
            step = max(1, _PHILOX_CHUNK // max(total, 1))
            for start in range(0, count, step):
                rows = slice(start, min(start + step, count))
                normal, offset = self.philox.normal_of(rows, total, tag=TAG_NOISE), 0
                for part, size in zip(parts, sizes):
                    part[rows].copy_(normal[:, offset : offset + size].reshape(part[rows].shape))
                    offset += size
            self.philox.advance()
            self._write_back()
            return

        targets = list(parts)
        if any(part.device.type != "cpu" for part in parts):
            # torch's CPU generators draw on the host (the CPU run's numbers), copied over once
            targets = self._host_parts(parts)

        def draw(rows: range) -> None:
            for row in rows:
                generator = self.generators[row]
                for part in targets:
                    part[row].normal_(generator=generator)

        workers, total = _workers(), sum(part.numel() for part in parts)
        if workers == 1 or count < 2 or total < _PARALLEL_MIN:
            draw(range(count))
        else:
            list(_thread_pool().map(draw, [range(w, count, workers) for w in range(workers)]))
        for part, target in zip(parts, targets):
            if target is not part:
                part.copy_(target)

    def _host_parts(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped like `parts` (those not on the CPU), in one reused buffer."""
        sizes = {
            dtype: sum(p.numel() for p in parts if p.dtype == dtype and p.device.type != "cpu")
            for dtype in {p.dtype for p in parts}
        }
        buffers = {}
        for dtype, size in sizes.items():
            scratch = self._scratch.get(f"host-{dtype}")
            if scratch is None or scratch.numel() < size:
                scratch = torch.empty(size, dtype=dtype, device="cpu")
                self._scratch[f"host-{dtype}"] = scratch
            buffers[dtype] = scratch
        out, offsets = [], dict.fromkeys(sizes, 0)
        for part in parts:
            if part.device.type == "cpu":
                out.append(part)
                continue
            start = offsets[part.dtype]
            out.append(buffers[part.dtype][start : start + part.numel()].view(part.shape))
            offsets[part.dtype] = start + part.numel()
        return out

    def _write_back(self) -> None:
        """Advance the parent's counters of the rows this sub-stream (from `take`) drew."""
        parent = getattr(self, "_parent", None)
        if parent is not None and parent.philox is not None and self.philox is not None:
            parent.philox.put(self._positions, self.philox)
            parent._write_back()


def _secret_normal(source: SecretSource, count: int) -> torch.Tensor:
    """(count,) float64 standard normals from `source`: Box-Muller on 53-bit uniforms
    (float64 throughout, so the tails are those of a Gaussian, not of a coarse grid)."""
    half = (count + 1) // 2
    uniform = source.uniform53(2 * half)
    radius = uniform[:half].log_().mul_(-2.0).sqrt_()
    angle = uniform[half:].mul_(2.0 * math.pi)
    out = torch.empty(
        2 * half, dtype=torch.float64, device="cpu"
    )  # keystream on the host; `fill` copies it over
    torch.mul(radius, torch.cos(angle), out=out[:half])
    torch.mul(radius, angle.sin_(), out=out[half:])
    return out[:count]
