"""The P4 paper's experiments as `p4bench reproduce` presets: heterogeneity, privacy,
ablation, defense and malicious (extended version, sections V-B, V-C and appendices B-D;
the claims in `p4bench_p4.claims`), registered by this plugin's `register_presets`.
"""

from __future__ import annotations

from typing import Any

from p4bench.studies.presets import NON_PRIVATE, Preset, alpha_variant, shard_variant
from p4bench_p4 import claims
from p4bench_p4.claims import ABLATIONS, ATTACKS

__all__ = ["DEFENSES", "EPSILONS", "P4_PRESETS"]

EPSILONS = (3.0, 5.0, 8.0, 10.0, 15.0, 20.0)
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


def _non_iid(dataset: str, quick: bool) -> dict[str, Any]:
    """The attack experiments' one setting: 50% similarity on CIFAR-10, N = 4 elsewhere."""
    if dataset in ("cifar100", "femnist"):
        return {k: v for k, v in shard_variant(dataset, quick, 4).items() if k != "label"}
    return {"partitioner": "alpha", "similarity": 0.5}


def _heterogeneity_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    methods = ["p4", "proxyfl", "dp-dsgt", "scaffold", "fedavg", "local", "centralized"]
    alphas = [{**alpha_variant(s), "method": methods} for s in (0.25, 0.5, 0.75)]
    shards = [{**shard_variant(dataset, quick, n), "method": methods} for n in (2, 4, 8)]
    return alphas + shards


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
    ]


def _ablation_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    epsilons = [3.0, 15.0] if quick else [3.0, 5.0, 10.0, 15.0, 20.0]
    p4 = {"method": "p4", "features": "scatter", "defense": "none", "epsilon": epsilons}
    return [
        {"label": "p4", **p4},
        *({"label": k, **p4, **v} for k, v in ABLATIONS.items()),
        {"label": "local (HC)", "method": "local", "features": "scatter", **NON_PRIVATE},
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
        "non-DP local training; centralized: a pooled reference, not a rival in the claims)",
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
        baselines='local training (raw and HC) is non-private, as the paper\'s "non-DP version of local training"',
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
        baselines="local training (HC) is non-private",
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
    ),
    Preset(
        "malicious",
        "10..50% malicious clients: P4 with secure aggregation vs the ideal defense, epsilon 15",
        ("cifar100", "femnist"),
        {"epsilon": 15.0, "features": "scatter", "model": "linear"},
        _malicious_variants,
        ("attack", "malicious_fraction", "defense"),
        claims.malicious_claims,
    ),
)
