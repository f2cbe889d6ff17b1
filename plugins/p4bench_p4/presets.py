"""The P4 paper's experiments as `p4bench reproduce` presets: heterogeneity, privacy,
ablation, defense and malicious (extended version, sections V-B, V-C and appendices B-D;
the claims in `p4bench_p4.claims`), registered by this plugin's `register_presets`.

Reference rows (a variant's `reference`, `p4bench.studies.sweep_plan.REFERENCE`: a row of
their own, never a side of a claim): the heterogeneity preset runs, beside the certified P4
and ProxyFL, the papers' own variant (`-o teacher=private`: the DP proxy distils from the
non-DP private model, so the epsilon is uncertified and marked so) at every level; and the
heterogeneity, privacy and ablation presets a non-private centralized ceiling (the pooled
records). The defense and malicious tables are keyed by attack and defense, which a method
with no aggregator cannot take: their no-attack P4 row is their reference.
"""

from __future__ import annotations

from typing import Any

from p4bench.studies.presets import NON_PRIVATE, Preset, alpha_variant, shard_variant
from p4bench.studies.sweep_plan import REFERENCE
from p4bench_p4 import claims
from p4bench_p4.claims import ABLATIONS, ATTACKS

__all__ = ["CEILING", "DEFENSES", "EPSILONS", "P4_PRESETS", "PAPER_VARIANT"]

EPSILONS = (3.0, 5.0, 8.0, 10.0, 15.0, 20.0)
# What the paper grid-searches besides eta_0 (p4.md section 8: K in 1..10, s and l in 0.1..1,
# C in 0.1..10), each method on the evaluation clients; tuned one axis at a time after lr.
TUNE_AXES = {
    "local_steps": (1, 5, 10),
    "data_rate": (0.1, 0.2, 0.5),
    "clip": (0.1, 1.0, 10.0),
    "client_rate": (0.5, 1.0),
}
# the attack experiments fix l = 1 (every client in every round), as the paper's do
ATTACK_TUNE_AXES = {k: v for k, v in TUNE_AXES.items() if k != "client_rate"}
# The existing defenses of the paper's RQ2 (FedSecurity's), then P4's own and the oracle.
DEFENSES = (
    "none",
    "m-krum",
    "krum",
    "bulyan",
    "anomaly-detection",
    "median",
    "trimmed-mean",
    "geometric-median",
    "norm-clipping",
    "centered-clipping",
    "foolsgold",
    "p4-secure",
    "ideal",
)


# the `reference` of the rows no claim uses (`p4bench.studies.sweep_plan.REFERENCE`)
PAPER_VARIANT = "paper's variant: teacher=private, uncertified"
CEILING = "non-private pooled ceiling"


def _non_iid(dataset: str, quick: bool) -> dict[str, Any]:
    """The attack experiments' one setting: 50% similarity on CIFAR-10, N = 4 elsewhere."""
    if dataset in ("cifar100", "femnist"):
        return {k: v for k, v in shard_variant(dataset, quick, 4).items() if k != "label"}
    return {"partitioner": "alpha", "similarity": 0.5}


def _heterogeneity_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    """Every method at every level; then, at every level, the centralized ceiling and P4 and
    ProxyFL as their papers run them (`PAPER_VARIANT`), after the certified runs (which
    lr tuning therefore picks for P4 and ProxyFL)."""
    methods = ["p4", "proxyfl", "dp-dsgt", "scaffold", "fedavg", "local"]
    levels = [alpha_variant(s) for s in (0.25, 0.5, 0.75)]
    levels += [shard_variant(dataset, quick, n) for n in (2, 4, 8)]
    paper = {"method": ["p4", "proxyfl"], "options.teacher": "private", REFERENCE: PAPER_VARIANT}
    return [
        *({**level, "method": methods} for level in levels),
        *(
            {**level, "method": "centralized", REFERENCE: CEILING, **NON_PRIVATE}
            for level in levels
        ),
        *({**level, **paper} for level in levels),
    ]


def _privacy_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    epsilons = [3.0, 15.0] if quick else list(EPSILONS)
    return [
        {
            "label": "p4 (HC)",
            "method": "p4",
            "features": "scatter",
            "defense": "none",
            "epsilon": epsilons,
        },
        {"label": "local", "method": "local", "features": "raw", **NON_PRIVATE},
        {"label": "local (HC)", "method": "local", "features": "scatter", **NON_PRIVATE},
        _ceiling(),
    ]


def _ceiling() -> dict[str, Any]:
    """Centralized training on the pooled records, HC features, non-private: a reference."""
    return {
        "label": "centralized (HC)",
        "method": "centralized",
        "features": "scatter",
        REFERENCE: CEILING,
        **NON_PRIVATE,
    }


def _ablation_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    epsilons = [3.0, 15.0] if quick else [3.0, 5.0, 10.0, 15.0, 20.0]
    p4 = {"method": "p4", "features": "scatter", "defense": "none", "epsilon": epsilons}
    return [
        {"label": "p4", **p4},
        *({"label": k, **p4, **v} for k, v in ABLATIONS.items()),
        {"label": "local (HC)", "method": "local", "features": "scatter", **NON_PRIVATE},
        _ceiling(),
    ]


def _defense_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    setting = {
        **_non_iid(dataset, quick),
        "method": "p4",
        "client_rate": 1.0,
        "malicious_fraction": 0.3,
    }
    return [
        {"label": "no attack", **setting, "attack": "none", "defense": "none"},
        {"label": "attacked", **setting, "attack": list(ATTACKS), "defense": list(DEFENSES)},
    ]


def _malicious_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    fractions = [0.1, 0.3, 0.5] if quick else [0.1, 0.2, 0.3, 0.4, 0.5]
    return [
        {
            **_non_iid(dataset, quick),
            "method": "p4",
            "client_rate": 1.0,
            "attack": list(ATTACKS),
            "defense": ["p4-secure", "ideal"],
            "malicious_fraction": fractions,
        }
    ]


P4_PRESETS: tuple[Preset, ...] = (
    Preset(
        "heterogeneity",
        "all methods under alpha (25/50/75%) and shard (N=2/4/8) heterogeneity, epsilon 15",
        ("cifar10", "cifar100", "femnist"),
        {"epsilon": 15.0, "features": "scatter", "model": "linear", "defense": "none"},
        _heterogeneity_variants,
        ("variant", "method"),
        claims.heterogeneity_claims,
        per_method={"local": NON_PRIVATE, "centralized": NON_PRIVATE},
        tune_at={"variant": "alpha 50%"},
        baselines="local and centralized training are non-private (local: nothing leaves a client, the paper's "
        "non-DP local training; centralized: the non-private pooled ceiling, a reference row no claim uses); "
        "p4 and proxyfl also run as their papers do (teacher=private: epsilon UNCERTIFIED), reference rows "
        "beside the certified ones that no claim uses",
        tune_axes=TUNE_AXES,
    ),
    Preset(
        "privacy",
        "P4 (HC) at epsilon 3..20 against non-private local training, alpha 50%",
        ("cifar10", "femnist"),
        {"partitioner": "alpha", "similarity": 0.5, "model": "linear"},
        _privacy_variants,
        ("variant", "epsilon"),
        claims.privacy_claims,
        tune_at={"epsilon": 15.0},
        baselines='local training (raw and HC) is non-private, as the paper\'s "non-DP version of local training"; '
        "centralized (HC) is the non-private pooled ceiling, a reference row no claim uses",
        tune_axes=TUNE_AXES,
    ),
    Preset(
        "ablation",
        "P4 with grouping, ScatterNet or the proxy switched off, alpha 50%, epsilon 3..20",
        ("cifar10",),
        {"partitioner": "alpha", "similarity": 0.5, "model": "linear"},
        _ablation_variants,
        ("variant", "epsilon"),
        claims.ablation_claims,
        tune_at={"epsilon": 15.0},
        baselines="local training (HC) is non-private; centralized (HC) is the non-private pooled ceiling, a "
        "reference row no claim uses",
        tune_axes=TUNE_AXES,
    ),
    Preset(
        "defense",
        "P4 under four attacks at 30% malicious clients with every defense, epsilon 15",
        ("cifar10", "cifar100", "femnist"),
        {"epsilon": 15.0, "features": "scatter", "model": "linear"},
        _defense_variants,
        ("attack", "defense"),
        claims.defense_claims,
        tune_at={"variant": "no attack"},
        baselines="no centralized ceiling: rows are keyed by attack and defense, which centralized training "
        "(no aggregator, nothing exchanged) cannot take; the no-attack P4 row is the reference",
        tune_axes=ATTACK_TUNE_AXES,
    ),
    Preset(
        "malicious",
        "10..50% malicious clients: P4 with secure aggregation vs the ideal defense, epsilon 15",
        ("cifar100", "femnist"),
        {"epsilon": 15.0, "features": "scatter", "model": "linear"},
        _malicious_variants,
        ("attack", "malicious_fraction", "defense"),
        claims.malicious_claims,
        baselines="no centralized ceiling: rows are keyed by attack, malicious fraction and defense, which "
        "centralized training (no aggregator, nothing exchanged) cannot take",
        tune_axes=ATTACK_TUNE_AXES,
    ),
)
