"""Per-client random streams that are identical however clients are batched.

Every client (and the server) owns a Philox4x32-10 counter-based stream: a draw is a
pure function of (client key, draw number, position), so the batched simulator, the
per-client reference loop and one-process-per-client runtimes produce bit-identical
randomness, and each client's stream is independent of every other client's. The
keys come from the run seed through numpy's SeedSequence (never from public round or
step numbers). Such streams are reproducible, not secret: anyone holding the run config
can recompute them.

Where clients are separate parties (devices), each client's private draws (Poisson
batches, the peers it samples, DP noise) must be unpredictable to the others: `SecretRng`
has `ClientRng`'s interface with its words from a `SecretSource` (a keystream under a
key from the OS CSPRNG), and nothing in it derives from the seed.

All arithmetic is done on int64 tensors holding 32-bit words; 32x32-bit products are
split into 16-bit limbs so nothing overflows.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "philox4x32",
    "node_keys",
    "ClientRng",
    "SecretSource",
    "SecretRng",
    "client_rng",
    "secret_draws",
    "SERVER_ID",
    "SEED_PARTITION",
    "SEED_MALICIOUS",
    "harness_rng",
]

SERVER_ID = -1
# Seed-derived numpy streams for harness decisions, never shared with training noise: the
# runner and `p4bench data partition` draw the same partition from SEED_PARTITION.
SEED_PARTITION, SEED_MALICIOUS = 7, 11
_MASK32 = 0xFFFFFFFF
_MUL = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of multiplier * word, both 32-bit: one 64-bit product.

    The product is below 2**64 but may exceed int64's range; int64 multiplication wraps
    modulo 2**64 (two's complement, on every device torch supports), which keeps all 64
    bits, so the arithmetic shift and the masks recover both halves exactly."""
    product = word * multiplier
    return (product >> 32) & _MASK32, product & _MASK32


def _round_keys(key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 10 round keys of each stream at once, (k + r * Weyl) mod 2**32 for r = 0..9,
    along a new last axis (one operation each, instead of two per round)."""
    bumps = torch.arange(10, dtype=torch.int64, device=key[0].device)
    return (
        (key[0].unsqueeze(-1) + bumps * _WEYL[0]) & _MASK32,
        (key[1].unsqueeze(-1) + bumps * _WEYL[1]) & _MASK32,
    )


def philox4x32(
    counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with 10 rounds on broadcastable int64 tensors of 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = _round_keys(key)
    for round_index in range(10):
        hi0, lo0 = _mulhilo(_MUL[0], c0)
        hi1, lo1 = _mulhilo(_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0[..., round_index], lo1, hi0 ^ c3 ^ k1[..., round_index], lo0
    return c0, c1, c2, c3


def _philox_counters(
    keys: torch.Tensor, calls: torch.Tensor, blocks: int, tag: int
) -> tuple[torch.Tensor, ...]:
    """The inputs of a draw, broadcastable to (rows, blocks): block j of row i is
    Philox(counter (j, calls lo, calls hi, tag), key i)."""
    device, count = keys.device, calls.unsqueeze(1)
    position = torch.arange(blocks, dtype=torch.int64, device=device).unsqueeze(0)
    return (
        position,
        count & _MASK32,
        count >> 32,
        torch.full_like(count, tag & _MASK32),
        keys[:, :1],
        keys[:, 1:],
    )


def _philox_block_words(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor,
    k1: torch.Tensor,
) -> torch.Tensor:
    """(rows, 4 * blocks) words of the counters and keys of `_philox_counters`."""
    rows, blocks = k0.shape[0], c0.shape[1]
    full = (
        c0.expand(rows, blocks),
        c1.expand(rows, blocks),
        c2.expand(rows, blocks),
        c3.expand(rows, blocks),
    )
    return torch.stack(philox4x32(full, (k0, k1)), dim=-1).reshape(rows, blocks * 4)


def _philox_words_eager(
    keys: torch.Tensor, calls: torch.Tensor, blocks: int, tag: int
) -> torch.Tensor:
    """(rows, 4 * blocks) words: block j of row i is Philox(counter (j, calls lo, calls hi, tag), key i)."""
    return _philox_block_words(*_philox_counters(keys, calls, blocks, tag))


# On CUDA the 130 elementwise operations of a draw are fused into one kernel by
# torch.compile (40x less memory traffic; the draw of P4's noise was most of a round's GPU
# time). The fused kernel is used only after it gave the eager words bit for bit on a
# check draw on that device; otherwise, or with P4BENCH_COMPILE=0, the eager version runs.
_FUSED: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None] = {}


def _fused_for(
    device: torch.device,
) -> Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None:
    """The checked fused draw for `device`, or None (eager)."""
    name = str(device)
    if name in _FUSED:
        return _FUSED[name]
    fused: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None = None
    if device.type == "cuda" and os.environ.get("P4BENCH_COMPILE", "1") != "0":
        try:
            compiled = torch.compile(_philox_block_words, dynamic=True)

            def candidate(
                keys: torch.Tensor, calls: torch.Tensor, blocks: int, tag: int
            ) -> torch.Tensor:
                words: torch.Tensor = compiled(*_philox_counters(keys, calls, blocks, tag))
                return words

            generator = torch.Generator().manual_seed(
                0
            )  # the check's inputs: drawn on the host, whatever the scope
            keys = torch.randint(
                0, 2**32, (5, 2), generator=generator, dtype=torch.int64, device="cpu"
            )
            calls = torch.tensor(
                [0, 1, 2**32 - 1, 2**32, 2**40 + 3], dtype=torch.int64, device="cpu"
            )
            keys[0] = _MASK32
            for blocks, tag in ((7, 0), (33, 0x4E4F)):
                with (
                    torch._C.DisableTorchFunction()
                ):  # the reference on the host, outside the run's device scope
                    expected = _philox_words_eager(keys, calls, blocks, tag)
                with torch._C.DisableTorchFunction():
                    got = candidate(keys.to(device), calls.to(device), blocks, tag).cpu()
                if not torch.equal(got, expected):
                    raise RuntimeError("the fused Philox draw differs from the eager one")
            fused = candidate
        except Exception as exc:  # noqa: BLE001 - no compiler, or a wrong kernel: the eager draw is always right
            warnings.warn(
                f"Philox streams on {device}: fused kernel unavailable ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); using the eager version",
                stacklevel=3,
            )
    _FUSED[name] = fused
    return fused


def philox_words(keys: torch.Tensor, calls: torch.Tensor, blocks: int, tag: int) -> torch.Tensor:
    """`_philox_words_eager`, fused into one kernel where that is available and checked."""
    fused = _fused_for(keys.device) if keys.device.type == "cuda" else None
    if fused is None:
        return _philox_words_eager(keys, calls, blocks, tag)
    with torch._C.DisableTorchFunction():  # the run's device scope is a function mode: not traced
        return fused(keys, calls, blocks, tag)


def node_keys(seed: int, node_ids: torch.Tensor | list[int], purpose: int = 0) -> torch.Tensor:
    """Secret 64-bit Philox keys (as two 32-bit words) for the given node ids.

    Node id -1 is the server. `purpose` separates independent families of streams
    (for example data sampling and DP noise) derived from one run seed.
    """
    ids = [int(i) for i in (node_ids.tolist() if isinstance(node_ids, torch.Tensor) else node_ids)]
    words = [
        np.random.SeedSequence([seed, purpose, i + 1]).generate_state(2, dtype=np.uint32)
        for i in ids
    ]
    return torch.tensor(np.array(words, dtype=np.int64).reshape(len(ids), 2), dtype=torch.int64)


class ClientRng:
    """The random streams of a set of nodes (rows), advanced draw by draw.

    `calls[i]` counts the draws node i has made; each draw uses the counter
    (position // 4, calls lo, calls hi, tag), so its values depend only on the node's
    own key and history, never on which other nodes are batched with it.
    """

    def __init__(self, keys: torch.Tensor, calls: torch.Tensor | None = None) -> None:
        self.keys = keys
        self.calls = (
            torch.zeros(keys.shape[0], dtype=torch.int64) if calls is None else calls.clone()
        )

    def __len__(self) -> int:
        return self.keys.shape[0]

    def bits(self, n: int, tag: int = 0) -> torch.Tensor:
        """(rows, n) uniformly random 32-bit words as int64; advances every row by one draw."""
        words = philox_words(self.keys, self.calls, (n + 3) // 4, tag)
        self.calls = self.calls + 1
        return words[:, :n]

    def _words(self, part: slice, n: int) -> torch.Tensor:
        """(rows of `part`, >= n) the words `bits(n)` would give those rows (no advance)."""
        return philox_words(self.keys[part], self.calls[part], (n + 3) // 4, 0)

    def uniform(self, n: int, tag: int = 0) -> torch.Tensor:
        """(rows, n) float64 uniforms in (0, 1) with 53 random bits each."""
        words = self.bits(2 * n, tag)
        high, low = words[:, 0::2] >> 5, words[:, 1::2] >> 6  # 27 + 26 bits
        return ((high * 67108864 + low).double() + 0.5) / 9007199254740992.0

    def normal(self, n: int, tag: int = 0) -> torch.Tensor:
        """(rows, n) float64 standard normals (Box-Muller on `uniform`)."""
        out = self.normal_of(slice(None), n, tag)
        self.calls = self.calls + 1
        return out

    def normal_of(self, rows: slice, n: int, tag: int = 0) -> torch.Tensor:
        """What `normal(n, tag)` gives the rows `rows`, without advancing any stream: a
        large draw can be made a few rows at a time (each row's numbers depend on its
        own key and count alone), then `advance()` once."""
        half = (n + 1) // 2
        words = philox_words(self.keys[rows], self.calls[rows], (4 * half + 3) // 4, tag)[
            :, : 4 * half
        ]
        high, low = words[:, 0::2] >> 5, words[:, 1::2] >> 6  # as `uniform`: 27 + 26 bits
        u = ((high * 67108864 + low).double() + 0.5) / 9007199254740992.0
        radius = torch.sqrt(-2.0 * torch.log(u[:, :half]))
        angle = 2.0 * torch.pi * u[:, half:]
        return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)[:, :n]

    def advance(self) -> None:
        """Count one draw for every row (after draws made with `normal_of`)."""
        self.calls = self.calls + 1

    def subsets(
        self, population: torch.Tensor, size: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `size[i]` of `population[i]` slots without replacement, per row.

        Returns (indices, mask) of shape (rows, width): the first `size[i]` entries of
        row i are distinct indices in [0, population[i]); `mask` marks them. Slot keys
        beyond a row's population sort last, so the result for a row does not depend on
        how wide other rows are.
        """
        slots = int(population.max()) if len(self) else 0
        device = self.keys.device
        order = torch.empty(len(self), min(width, slots), dtype=torch.int64, device=device)
        block = max(
            1, (1 << 22) // max(slots, 1)
        )  # rows at a time: the keys of all rows are (rows, M)
        for start in range(0, len(self), block):
            part = slice(start, start + block)
            keys = self._words(part, max(slots, 1))[:, :slots]
            beyond = torch.arange(slots, device=device) >= population[part].unsqueeze(1)
            order[part] = torch.argsort(keys.masked_fill_(beyond, 1 << 40), dim=1, stable=True)[
                :, :width
            ]
        self.calls = self.calls + 1  # one draw, as `bits`
        mask = torch.arange(order.shape[1], device=device) < size.unsqueeze(1)
        return order, mask

    def take(self, rows: torch.Tensor) -> ClientRng:
        """The streams of a subset of rows (a copy; write back with `put`)."""
        return ClientRng(self.keys[rows], self.calls[rows])

    def put(self, rows: torch.Tensor, sub: ClientRng) -> None:
        """Write back the advanced draw counters of a subset taken with `take`."""
        self.calls = self.calls.clone()
        self.calls[rows] = sub.calls


class SecretSource:
    """Secret random bytes: AES-256-CTR keystream under a fresh key from `os.urandom`.

    A standard CSPRNG construction (as NIST's CTR_DRBG): unpredictable to anyone without
    the key, which never leaves this object, and several times faster than reading
    `os.urandom` for every draw (noise for large models). A forked child rekeys, so
    processes never share a keystream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zeros = bytearray()
        self._rekey()

    def _rekey(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._pid = os.getpid()
        self._encryptor = Cipher(
            algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))
        ).encryptor()

    def read(self, nbytes: int) -> bytearray:
        """`nbytes` fresh secret bytes (a writable buffer, for `torch.frombuffer`)."""
        out = bytearray(nbytes + 16)  # update_into wants one block of headroom
        with self._lock:
            if self._pid != os.getpid():
                self._rekey()
            if len(self._zeros) < nbytes:
                self._zeros = bytearray(nbytes)
            written = self._encryptor.update_into(memoryview(self._zeros)[:nbytes], out)
        if written != nbytes:  # CTR is a stream mode: it never buffers
            raise RuntimeError(f"keystream returned {written} of {nbytes} bytes")
        del out[nbytes:]
        return out

    def words(self, rows: int, n: int) -> torch.Tensor:
        """(rows, n) uniformly random 32-bit words as int64."""
        if rows * n == 0:
            return torch.zeros(rows, n, dtype=torch.int64, device="cpu")
        raw = torch.frombuffer(self.read(4 * rows * n), dtype=torch.int32).view(rows, n)
        return raw.to(torch.int64) & _MASK32

    def uniform53(self, count: int) -> torch.Tensor:
        """(count,) float64 uniforms in (0, 1) with 53 random bits each."""
        if count == 0:
            return torch.zeros(0, dtype=torch.float64, device="cpu")
        raw = torch.frombuffer(self.read(8 * count), dtype=torch.int64)
        return raw.bitwise_and_((1 << 53) - 1).double().add_(0.5).mul_(2.0**-53)


class SecretRng(ClientRng):
    """`ClientRng`'s interface (bits, uniform, normal, subsets, take, put) with every
    word secret: from a `SecretSource`, nothing derived from the run seed.

    Draws are not reproducible, and a row's draws do not depend on anything another
    party can know. `take` shares the source, so sub-streams stay secret; `calls` still
    counts each row's draws, as `ClientRng` does.
    """

    def __init__(
        self, rows: int, calls: torch.Tensor | None = None, source: SecretSource | None = None
    ) -> None:
        self.rows = int(rows)
        self.keys = torch.zeros(self.rows, 0, dtype=torch.int64)  # no key: nothing to recompute
        self.calls = torch.zeros(self.rows, dtype=torch.int64) if calls is None else calls.clone()
        self.source = source if source is not None else SecretSource()

    def __len__(self) -> int:
        return self.rows

    def bits(self, n: int, tag: int = 0) -> torch.Tensor:
        """(rows, n) uniformly random secret 32-bit words as int64; `tag` is ignored."""
        self.calls = self.calls + 1
        return self.source.words(self.rows, n).to(
            self.calls.device
        )  # keystream on the host, used where the run is

    def _words(self, part: slice, n: int) -> torch.Tensor:
        return self.source.words(len(range(*part.indices(self.rows))), n).to(self.calls.device)

    def take(self, rows: torch.Tensor) -> SecretRng:
        """The streams of a subset of rows (sharing the source; write back with `put`)."""
        return SecretRng(len(rows), self.calls[rows], self.source)


def client_rng(
    seed: int, node_ids: torch.Tensor | list[int], purpose: int, secret: bool
) -> ClientRng:
    """The streams of `node_ids`: secret (`SecretRng`) or reproducible from the seed."""
    count = len(node_ids)
    return SecretRng(count) if secret else ClientRng(node_keys(seed, node_ids, purpose))


def secret_draws(noise_source: str, separate_parties: bool) -> bool:
    """Whether a run's per-client private draws are secret: `secure`, or `auto` where
    clients are separate parties (the runner resolves `auto` the same way beforehand;
    this covers configs that reach a runtime unresolved, e.g. on a device peer)."""
    return noise_source == "secure" or (noise_source == "auto" and separate_parties)


def harness_rng(seed: int, stream: int) -> np.random.Generator:
    """The public numpy stream `stream` (e.g. `SEED_PARTITION`) of a run seed."""
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))
