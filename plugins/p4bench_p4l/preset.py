"""The `p4l` preset of `p4bench reproduce`: Arapakis et al., "P4L: Privacy-Preserving
Peer-to-Peer Learning for Infrastructureless Setups" (`shared/reference/seed-003-p4l.md`,
sections 2-3), with method `p4l` (no DP, as in the paper).

Data: digits (offline) stands in for CIFAR-10, Avito and IMDB, which are not available
offline: 30 peers of 48 records (the paper: 1,000 peers of 50), batches of about 16 (data
rate 0.5, the paper's bs=16), the suite's linear model (the paper's trainable part is a
dense head on a frozen backbone; kde-noise's default, the last two dense layers, is the
linear model's one dense layer here), the paper's stop rule mrt = 50, mrr = 0.5
(capped at 100 rounds). The paper's factors, as three blocks of runs (`p4l_variants`):

- `synergy size x IID` (no attack): size fixed 3, 5, 10 or power law over [3, 10], on an
  IID split and a non-IID one. The paper's non-IID gives each peer 6 of the 10 classes:
  the `shards` partitioner with 6 shards per peer is the closest (6 random classes, one
  shard each; 48 records divide by 6 and 30 * 6 / 10 is whole, as shards needs).
- `byzantine x attack` (power-law sizes, IID, the paper's setting after its section V-B):
  label-flip-pair (classes 0 <-> 5, its CIFAR-10 pair; 0 and 5 are digits here),
  label-flip-random-pair, label-shuffle and kde-noise at 10, 20 and 30% Byzantine peers;
  the no-attack baseline is the first block's power-law IID run.
- `HE vs plaintext` (size 5, IID and non-IID, 10 rounds): crypto paillier (2048-bit keys,
  the real default; 1024 in a quick run) against plaintext on the same seeds (R10). Every
  other run uses plaintext: the same protocol and sums (up to the 1e-10 fixed point),
  without the seconds of Paillier work a round; R10 is checked on this block alone.
- `classical`: centralized training on the pooled records, beside R2's reference values:
  the non-private pooled ceiling, a reference row (`CEILING`) that no claim uses.
- `FL baseline`: the paper's FedAvg (power-law client sampling, `client_sampling=powerlaw`,
  a tenth of the peers a round as its 100 of 1,000, 5 local epochs, 50 rounds) on the IID
  and non-IID splits. Every run is scored on the global test set (the paper's held-out
  set), each peer's own split beside.

Cost (2 cores, `-j 2`): 75 runs and 12 lr-tuning runs in about 10 minutes, much of it
the six 2048-bit Paillier runs; a quick run (one seed, 3 rounds, 15 peers, shorter lists)
in about 30 s.
lr is tuned per method (plain SGD) on the evaluation peers, on `TUNE_GRID`.

Claims (`p4l_claims`, in `p4bench_p4l.preset_claims`, paired by seed with 95% intervals):
(a) R10, HE vs plaintext within 1 point per setting; (b) R13, the Byzantine fraction is the
least influential factor (`factor_effects`: each factor's spread of mean accuracy over its
levels); R9, P4L competitive with FL on non-IID data (within 5 points); (b) and R9 are the
paper's for Avito and IMDB: "not tested" unless that dataset ran. `p4l_report` (`presets_p4l_report`)
prints that computation, R2's figures as reference values, R1 (the loss drops within the
first 5 participations) from the runs' `participation_curve.csv`, and draws the plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p4bench.studies.claims import pct
from p4bench.studies.sweep_plan import REFERENCE

__all__ = [
    "ATTACKS",
    "ATTACKED",
    "CEILING",
    "CLASSICAL",
    "FACTORS",
    "FL",
    "FRACTIONS",
    "GROUP_BY",
    "GRID",
    "HE",
    "SIZES",
    "TUNE_GRID",
    "FactorEffect",
    "factor_effects",
    "p4l_per_method",
    "p4l_settings",
    "p4l_variants",
    "partition_level",
    "size_level",
]

GRID, ATTACKED, HE, CLASSICAL = (
    "synergy size x IID",
    "byzantine x attack",
    "HE vs plaintext",
    "classical",
)
CEILING = "non-private pooled ceiling"  # classical's `reference` (`sweep_plan.REFERENCE`)
FL = "FL baseline"  # the paper's: FedAvg, 50 rounds, 100 of 1,000 clients a round drawn by power law, 5 local epochs
FL_SETTING = {
    "method": "fedavg",
    "options.client_sampling": "powerlaw",
    "options.epochs": 5,
    "client_rate": 0.1,
    "attack": "none",
}
FL_POINTS = 0.05  # R9 "competitive": within this much accuracy of FL (our reading of the word)
SIZES: dict[str, dict[str, Any]] = {
    "fixed 3": {"options.size_dist": "fixed", "options.size": 3},
    "fixed 5": {"options.size_dist": "fixed", "options.size": 5},
    "fixed 10": {"options.size_dist": "fixed", "options.size": 10},
    "powerlaw 3-10": {
        "options.size_dist": "powerlaw",
        "options.size_min": 3,
        "options.size_max": 10,
    },
}
QUICK_SIZES = ("fixed 3", "powerlaw 3-10")
PARTITIONS: dict[str, dict[str, Any]] = {
    "IID": {"partitioner": "iid"},
    "non-IID": {"partitioner": "shards", "options.shards_per_client": 6},
}
ATTACKS = ("label-flip-pair", "label-flip-random-pair", "label-shuffle", "kde-noise")
FRACTIONS = (0.1, 0.2, 0.3)
QUICK_FRACTIONS = (0.1, 0.3)
ATTACK_SETTING = ("powerlaw 3-10", "IID")  # where the attacks run (and their no-attack baseline)
HE_ROUNDS = (
    10  # Paillier at 2048 bits costs seconds a round: a shorter horizon, the same for both backends
)
# the table's keys; `seed` keeps the HE pairs matched by seed (every row is one run)
SIZE_DIST, SIZE, CRYPTO = "options.size_dist", "options.size", "options.crypto"
GROUP_BY = (
    "variant",
    "partitioner",
    SIZE_DIST,
    SIZE,
    "attack",
    "malicious_fraction",
    CRYPTO,
    "seed",
)
FACTORS = ("synergy size", "IID / non-IID", "attack", "Byzantine %")
HE_POINTS = 0.01  # claim (a): at most 1 point of accuracy between the backends
# lr candidates (plain SGD on the linear model): the suite's default grid picked its top, 2, for P4L
TUNE_GRID = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


# -- the runs -----------------------------------------------------------------------------------


def p4l_settings(dataset: str, quick: bool) -> dict[str, Any]:
    """Peers, records and scale: 30 peers of 48 records (15 in a quick run, 3 rounds)."""
    return {
        "clients": 15 if quick else 30,
        "samples_per_client": 48,
        "data_rate": 0.5,
        "model": "linear",
        "rounds": 3 if quick else 100,
        "malicious_fraction": 0.0,
        "epsilon": "none",
        "no_dp": True,
    }


def p4l_per_method(quick: bool) -> dict[str, dict[str, Any]]:
    """P4L's own options (not the centralized baseline's): plaintext sums unless a variant
    says otherwise, the paper's stop rule."""
    return {"p4l": {CRYPTO: "plaintext", "options.mrt": 50, "options.mrr": 0.5}}


def p4l_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    """The three blocks of the module docstring and the classical baseline (50 rounds of SGD
    on the pooled records); a quick run keeps two sizes, two fractions and one HE pair."""
    sizes = QUICK_SIZES if quick else tuple(SIZES)
    size, partition = ATTACK_SETTING
    paillier = {CRYPTO: "paillier", "options.key_bits": 1024 if quick else 2048}
    he_partitions = ("IID",) if quick else tuple(PARTITIONS)
    he_rounds = {} if quick else {"rounds": HE_ROUNDS}
    return [
        *(
            {"label": GRID, "method": "p4l", **SIZES[s], **PARTITIONS[p], "attack": "none"}
            for s in sizes
            for p in PARTITIONS
        ),
        {
            "label": ATTACKED,
            "method": "p4l",
            **SIZES[size],
            **PARTITIONS[partition],
            "attack": list(ATTACKS),
            "malicious_fraction": list(QUICK_FRACTIONS if quick else FRACTIONS),
        },
        *(
            {
                "label": HE,
                "method": "p4l",
                **SIZES["fixed 5"],
                **PARTITIONS[p],
                "attack": "none",
                **he_rounds,
                **crypto,
            }
            for p in he_partitions
            for crypto in (paillier, {CRYPTO: "plaintext"})
        ),
        {
            "label": CLASSICAL,
            "method": "centralized",
            REFERENCE: CEILING,
            "partitioner": "iid",
            "attack": "none",
            **({} if quick else {"rounds": 50}),
        },
        *(
            {"label": FL, **FL_SETTING, **PARTITIONS[p], **({} if quick else {"rounds": 50})}
            for p in PARTITIONS
        ),
    ]


# -- factor levels from the table ----------------------------------------------------------------


def _text(value: Any) -> str:
    """A table cell as plain text: plugin options are logged JSON-encoded ('"fixed"')."""
    text = str(value)
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def size_level(dist: Any, size: Any) -> str:
    """The synergy size level of a row (`SIZES`' labels)."""
    if _text(dist) == "powerlaw":
        return "powerlaw 3-10"
    try:
        return f"fixed {int(float(_text(size)))}"
    except (TypeError, ValueError):  # a row without synergies (the FL baseline, centralized)
        return "-"


def partition_level(partitioner: Any) -> str:
    return "IID" if str(partitioner) == "iid" else "non-IID"


def _cells(table: Any, variant: str) -> dict[tuple[str, str, str, float], float]:
    """{(size, partition, attack, fraction): mean over seeds} of the plaintext P4L rows of a block."""
    rows = table[
        (table["variant"].astype(str) == variant) & (table[CRYPTO].map(_text) != "paillier")
    ]
    sums: dict[tuple[str, str, str, float], list[float]] = {}
    for row in rows.to_dict("records"):
        key = (
            size_level(row[SIZE_DIST], row[SIZE]),
            partition_level(row["partitioner"]),
            str(row["attack"]),
            float(row["malicious_fraction"]),
        )
        sums.setdefault(key, []).append(float(row["mean"]))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _average(cells: Mapping[Any, float], level: Callable[[Any], str]) -> dict[str, float]:
    """{level: mean of the cells at that level}: the other factors averaged out."""
    groups: dict[str, list[float]] = {}
    for key, value in cells.items():
        groups.setdefault(level(key), []).append(value)
    return {k: sum(v) / len(v) for k, v in groups.items()}


@dataclass(frozen=True)
class FactorEffect:
    factor: str
    levels: dict[str, float]  # level -> mean accuracy, the other factors averaged out
    over: str  # the rows each level's mean averages over

    @property
    def spread(self) -> float:
        """max - min of the level means (NaN below two levels)."""
        return (
            max(self.levels.values()) - min(self.levels.values())
            if len(self.levels) >= 2
            else math.nan
        )

    def line(self) -> str:
        levels = ", ".join(f"{k} {pct(v)}" for k, v in self.levels.items())
        return f"{self.factor}: {levels}; spread {100 * self.spread:.2f} points ({self.over})"


def factor_effects(table: Any) -> list[FactorEffect]:
    """Each factor's mean accuracy per level, on the rows where it varies (seeds averaged
    first): size and IID / non-IID on the no-attack grid, each averaged over the other;
    attack on the attack block plus its no-attack baseline (the grid's power-law IID
    cell), averaged over the Byzantine fractions; Byzantine % on the attack block,
    averaged over the four attacks."""
    grid, attacked = _cells(table, GRID), _cells(table, ATTACKED)
    baseline = {k: v for k, v in grid.items() if k[:2] == ATTACK_SETTING}
    return [
        FactorEffect(
            "synergy size", _average(grid, lambda k: k[0]), "no attack, mean over IID and non-IID"
        ),
        FactorEffect(
            "IID / non-IID",
            _average(grid, lambda k: k[1]),
            "no attack, mean over the synergy sizes",
        ),
        FactorEffect(
            "attack",
            {**_average(baseline, lambda k: "none"), **_average(attacked, lambda k: k[2])},
            f"{' '.join(ATTACK_SETTING)}, attacks averaged over the Byzantine fractions",
        ),
        FactorEffect(
            "Byzantine %",
            _average(attacked, lambda k: f"{100 * k[3]:g}%"),
            f"{' '.join(ATTACK_SETTING)}, mean over the attacks",
        ),
    ]


# -- claims: `p4bench_p4l.preset_claims` (read from here too) ---------------------------------

_CLAIMS = ("byzantine_claim", "fl_claim", "he_claim", "p4l_claims")


def __getattr__(name: str) -> Any:
    if name in _CLAIMS:
        from p4bench_p4l import preset_claims

        return getattr(preset_claims, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
