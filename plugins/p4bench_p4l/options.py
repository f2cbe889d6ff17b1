"""P4L's options (``-o key=value``): the chains' cryptography, synergy sizes and sampling,
local training, accept-if-better and merging, stopping (mrt/mrr), faults and proximity."""

from __future__ import annotations

from p4bench.options import Option
from p4bench_p4l.chain_crypto import BACKEND_NAMES, KEY_BITS
from p4bench_p4l.merge import MERGES
from p4bench_p4l.plan import LAWS, SIZE_LAWS

__all__ = ["OPTIONS"]

OPTIONS = (
    Option(
        "crypto",
        str,
        "paillier",
        "paillier (python-paillier with gmpy2, packed 64-bit slots, fixed point "
        "1e10) or plaintext (the same protocol with exact sums, for fast sweeps)",
        choices=BACKEND_NAMES,
    ),
    Option(
        "key_bits",
        int,
        2048,
        "Paillier modulus bits (below 2048 only for tests)",
        choices=KEY_BITS,
    ),
    Option(
        "size",
        int,
        5,
        "synergy size with size_dist=fixed (members, the initiator included)",
        low=3,
        high=10,
    ),
    Option(
        "size_min",
        int,
        3,
        "smallest synergy with size_dist=powerlaw",
        low=3,
        high=10,
        paper="Table I, 3-10",
    ),
    Option(
        "size_max",
        int,
        10,
        "largest synergy with size_dist=powerlaw",
        low=3,
        high=10,
        paper="Table I, 3-10",
    ),
    Option(
        "size_dist",
        str,
        "fixed",
        "synergy sizes: fixed (option size) or powerlaw (a=2) over [size_min, size_max]",
        choices=SIZE_LAWS,
    ),
    Option(
        "sampling",
        str,
        "uniform",
        "initiator and successor choice: uniform or powerlaw (a=2)",
        choices=LAWS,
        paper="Table I, P_i = 1/N",
    ),
    Option(
        "synergies",
        int,
        None,
        "synergies started per round (distinct initiators); default: clients // 5",
        low=1,
    ),
    Option(
        "epochs",
        int,
        None,
        "local epochs per round, each ceil(1/data_rate) steps; default: local_steps",
        low=1,
    ),
    Option(
        "val_fraction",
        float,
        0.2,
        "share of each peer's records held out to score models for "
        "accept-if-better (0: score on the training records, the paper's 'own data')",
        low=0,
        high=1,
        high_open=True,
    ),
    Option(
        "accept_gate",
        bool,
        True,
        "accept-if-better: keep an average only if it scores at least as well as the own model",
        paper="section III",
    ),
    Option(
        "merge",
        str,
        "best",
        "several averages in one round: best (the best accepted one) or mean (the "
        "mean of the accepted ones)",
        choices=MERGES,
    ),
    Option(
        "mrt",
        int,
        50,
        "stop once mrr of the peers took part in mrt completed synergies",
        low=1,
        paper="Table I",
    ),
    Option(
        "mrr",
        float,
        0.5,
        "the share of peers that must reach mrt",
        low=0,
        high=1,
        low_open=True,
        paper="Table I",
    ),
    Option(
        "retries", int, 2, "R: retries with another peer after a missing beacon", low=0, high=20
    ),
    Option(
        "drop_prob",
        float,
        0.0,
        "churn: probability that a peer is out of reach when a token arrives",
        low=0,
        high=1,
        high_open=True,
    ),
    Option(
        "crash_prob",
        float,
        0.0,
        "probability that an initiator crashes right after sending its token (its synergy aborts)",
        low=0,
        high=1,
    ),
    Option(
        "global_timeout",
        int,
        None,
        "ticks (t_p) after which an initiator gives up; default: size + retries",
        low=1,
    ),
    Option(
        "proximity",
        str,
        "complete",
        "who a peer can reach: a topology plugin (default: everyone)",
    ),
)
