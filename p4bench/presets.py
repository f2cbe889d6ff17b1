"""The presets of `p4bench reproduce`: the P4 paper's experiments as sweep grids (and
Karras et al.'s, whose variants, claims and report live in `p4bench.presets_karras`, and
Arapakis et al.'s P4L, in `p4bench.presets_p4l` and `p4bench.presets_p4l_report`, and Wang
et al.'s PDSL, in `p4bench.presets_pdsl` and `p4bench.presets_pdsl_report`).

Data settings (`shared/reference/p4.md` section 8; digits is the offline fallback), the
variants of each preset and the `Preset` records themselves. How they run, are tuned and
checked is `p4bench.reproduce`'s business (see its docstring for the equal-privacy rules
every preset follows: one relation, `RELATION`; non-private local and centralized).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any

from p4bench import claims
from p4bench.claims import ABLATIONS, ATTACKS, ClaimCheck, ClaimContext
from p4bench.presets_karras import karras_claims, karras_per_method, karras_report, karras_settings, karras_variants
from p4bench.presets_p4l import GROUP_BY as P4L_GROUP_BY
from p4bench.presets_p4l import TUNE_GRID as P4L_TUNE_GRID
from p4bench.presets_p4l import p4l_claims, p4l_per_method, p4l_settings, p4l_variants
from p4bench.presets_p4l_report import p4l_report
from p4bench.presets_pdsl import GROUP_BY as PDSL_GROUP_BY
from p4bench.presets_pdsl import TUNE_AT as PDSL_TUNE_AT
from p4bench.presets_pdsl import TUNE_GRID as PDSL_TUNE_GRID
from p4bench.presets_pdsl import pdsl_claims, pdsl_per_method, pdsl_settings, pdsl_variants
from p4bench.presets_pdsl_report import pdsl_report

__all__ = [
    "DATASETS", "DEFENSES", "EPSILONS", "FULL", "NON_PRIVATE", "PRESETS", "Preset", "QUICK", "QUICK_DIGITS", "RELATION",
    "alpha_variant", "data_settings", "describe_presets", "shard_variant",
]

# The paper's data settings (p4.md section 8); digits is the offline fallback.
DATASETS: dict[str, dict[str, int]] = {
    "cifar10": {"classes": 10, "clients": 260, "samples_per_client": 200},
    "femnist": {"classes": 47, "clients": 200, "samples_per_client": 300},
    "cifar100": {"classes": 100, "clients": 60, "samples_per_client": 250},
    "digits": {"classes": 10, "clients": 20, "samples_per_client": 80},
}
QUICK_DIGITS = {"clients": 10}
FULL: dict[str, Any] = {"rounds": 100, "seeds": (0, 1, 2)}
QUICK: dict[str, Any] = {"rounds": 3, "seeds": (0,)}
EPSILONS = (3.0, 5.0, 8.0, 10.0, 15.0, 20.0)
# The existing defenses of the paper's RQ2 (FedSecurity's), then P4's own and the oracle.
DEFENSES = ("none", "m-krum", "krum", "bulyan", "anomaly-detection", "median", "trimmed-mean", "geometric-median",
            "norm-clipping", "centered-clipping", "foolsgold", "p4-secure", "ideal")
NON_PRIVATE = {"epsilon": "none", "no_dp": True}  # also for DP methods, private by default
RELATION = "add-remove"  # every preset's neighbouring relation (see the module docstring)


EVAL_METRICS = {"personal": "final_accuracy_mean", "global": "final_accuracy_global_mean"}


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    datasets: tuple[str, ...]  # the paper's; the first is the default
    base: Mapping[str, Any]
    variants: Callable[[str, bool], list[dict[str, Any]]]  # (dataset, quick) -> variants
    group_by: tuple[str, ...]
    claims: Callable[[Any, ClaimContext], list[ClaimCheck]]
    per_method: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    neighbouring: str = RELATION  # the one relation of every private run
    tune_at: Mapping[str, Any] = field(default_factory=dict)  # the setting lr is tuned at (a `variant` or options)
    baselines: str = ""  # which local / centralized baselines are private, and why
    # (dataset, quick) -> base options that replace `DATASETS`'s and the scale's (clients, rounds, ...)
    settings: Callable[[str, bool], Mapping[str, Any]] | None = None
    per_method_for: Callable[[bool], Mapping[str, Mapping[str, Any]]] | None = None  # (quick) -> per_method
    tune_grid: Sequence[float] = ()  # lr candidates; empty: reproduce.TUNE_GRID
    quick_tune_grid: Sequence[float] = ()  # empty: reproduce.QUICK_TUNE_GRID
    # (table or None, context, results folder, experiment) -> lines printed after the table
    report: Callable[[Any, ClaimContext, Path, str], list[str]] | None = None
    # the paper's metric: "global" (one held-out test set, the table's and the claims'), or
    # "personal" (each client's own test split); the other is printed beside (`--eval both`)
    eval_set: str = "personal"

    @property
    def metric(self) -> str:
        """The MLflow metric of the table and the claims."""
        return EVAL_METRICS[self.eval_set]

    @property
    def beside_metric(self) -> str:
        """The other accuracy, printed beside the table."""
        return EVAL_METRICS["personal" if self.eval_set == "global" else "global"]


# -- data settings ----------------------------------------------------------------------


def data_settings(dataset: str, quick: bool) -> dict[str, int]:
    settings = dict(DATASETS.get(dataset, {"classes": 0, "clients": 20, "samples_per_client": 80}))
    if quick and dataset == "digits":
        settings.update(QUICK_DIGITS)
    return settings


def shard_variant(dataset: str, quick: bool, per_client: int) -> dict[str, Any]:
    """Shards with N classes per client at the nearest valid client count (M*N/L integer)."""
    settings = data_settings(dataset, quick)
    classes, clients, samples = settings["classes"], settings["clients"], settings["samples_per_client"]
    variant: dict[str, Any] = {"label": f"shards N={per_client}", "partitioner": "shards",
                               "options.shards_per_client": per_client}
    if classes:
        step = classes // gcd(classes, per_client)
        variant["clients"] = max(step, int(round(clients / step)) * step)
        variant["samples_per_client"] = samples - samples % per_client
    return variant


def alpha_variant(similarity: float) -> dict[str, Any]:
    return {"label": f"alpha {int(round(similarity * 100))}%", "partitioner": "alpha", "similarity": similarity}


def _non_iid(dataset: str, quick: bool) -> dict[str, Any]:
    """The attack experiments' one setting: 50% similarity on CIFAR-10, N = 4 elsewhere."""
    if dataset in ("cifar100", "femnist"):
        return {k: v for k, v in shard_variant(dataset, quick, 4).items() if k != "label"}
    return {"partitioner": "alpha", "similarity": 0.5}


# -- presets ----------------------------------------------------------------------------


def _heterogeneity_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    methods = ["p4", "proxyfl", "dp-dsgt", "scaffold", "fedavg", "local", "centralized"]
    alphas = [{**alpha_variant(s), "method": methods} for s in (0.25, 0.5, 0.75)]
    shards = [{**shard_variant(dataset, quick, n), "method": methods} for n in (2, 4, 8)]
    return alphas + shards


def _privacy_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    epsilons = [3.0, 15.0] if quick else list(EPSILONS)
    return [
        {"label": "p4 (HC)", "method": "p4", "features": "scatter", "defense": "none", "epsilon": epsilons},
        {"label": "local", "method": "local", "features": "raw", **NON_PRIVATE},
        {"label": "local (HC)", "method": "local", "features": "scatter", **NON_PRIVATE},
    ]


def _ablation_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    epsilons = [3.0, 15.0] if quick else [3.0, 5.0, 10.0, 15.0, 20.0]
    p4 = {"method": "p4", "features": "scatter", "defense": "none", "epsilon": epsilons}
    return [{"label": "p4", **p4}, *({"label": k, **p4, **v} for k, v in ABLATIONS.items()),
            {"label": "local (HC)", "method": "local", "features": "scatter", **NON_PRIVATE}]


def _defense_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    setting = {**_non_iid(dataset, quick), "method": "p4", "client_rate": 1.0, "malicious_fraction": 0.3}
    return [{"label": "no attack", **setting, "attack": "none", "defense": "none"},
            {"label": "attacked", **setting, "attack": list(ATTACKS), "defense": list(DEFENSES)}]


def _malicious_variants(dataset: str, quick: bool) -> list[dict[str, Any]]:
    fractions = [0.1, 0.3, 0.5] if quick else [0.1, 0.2, 0.3, 0.4, 0.5]
    return [{**_non_iid(dataset, quick), "method": "p4", "client_rate": 1.0, "attack": list(ATTACKS),
             "defense": ["p4-secure", "ideal"], "malicious_fraction": fractions}]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("heterogeneity", "all methods under alpha (25/50/75%) and shard (N=2/4/8) heterogeneity, epsilon 15",
               ("cifar10", "cifar100", "femnist"), {"epsilon": 15.0, "features": "scatter", "model": "linear",
                                                    "defense": "none"},
               _heterogeneity_variants, ("variant", "method"), claims.heterogeneity_claims,
               per_method={"local": NON_PRIVATE, "centralized": NON_PRIVATE}, tune_at={"variant": "alpha 50%"},
               baselines="local and centralized training are non-private (local: nothing leaves a client, the paper's "
                         "non-DP local training; centralized: a pooled reference, not a rival in the claims)"),
        Preset("privacy", "P4 (HC) at epsilon 3..20 against non-private local training, alpha 50%",
               ("cifar10", "femnist"), {"partitioner": "alpha", "similarity": 0.5, "model": "linear"},
               _privacy_variants, ("variant", "epsilon"), claims.privacy_claims, tune_at={"epsilon": 15.0},
               baselines="local training (raw and HC) is non-private, as the paper's \"non-DP version of local training\""),
        Preset("ablation", "P4 with grouping, ScatterNet or the proxy switched off, alpha 50%, epsilon 3..20",
               ("cifar10",), {"partitioner": "alpha", "similarity": 0.5, "model": "linear"},
               _ablation_variants, ("variant", "epsilon"), claims.ablation_claims, tune_at={"epsilon": 15.0},
               baselines="local training (HC) is non-private"),
        Preset("defense", "P4 under four attacks at 30% malicious clients with every defense, epsilon 15",
               ("cifar10", "cifar100", "femnist"), {"epsilon": 15.0, "features": "scatter", "model": "linear"},
               _defense_variants, ("attack", "defense"), claims.defense_claims, tune_at={"variant": "no attack"}),
        Preset("malicious", "10..50% malicious clients: P4 with secure aggregation vs the ideal defense, epsilon 15",
               ("cifar100", "femnist"), {"epsilon": 15.0, "features": "scatter", "model": "linear"},
               _malicious_variants, ("attack", "malicious_fraction", "defense"), claims.malicious_claims),
        Preset("karras", "Karras et al. (P2P FL on Raspberry Pis): CBDS undersampling, FedDF vs FedAvg under random-label "
                         "clients and at alpha 0.01, Table III beside ours; global test set; non-private",
               ("cifar10",), {}, karras_variants, ("variant", "method", "malicious_fraction"), karras_claims,
               settings=karras_settings, per_method_for=karras_per_method,
               tune_at={"variant": "noisy clients", "malicious_fraction": 0.0},
               tune_grid=(1e-4, 5e-4, 1e-3, 5e-3, 0.05, 0.5), quick_tune_grid=(5e-4, 0.05), report=karras_report,
               baselines="every run is non-private, as in the paper (it uses no DP): no epsilon to equalise",
               eval_set="global"),
        Preset("p4l", "Arapakis et al. (P4L): synergy size, IID vs non-IID, Paillier vs plaintext and Byzantine % x "
                      "attack; digits stands in for CIFAR-10/Avito/IMDB (not available offline); no DP",
               ("digits",), {}, p4l_variants, P4L_GROUP_BY, p4l_claims, settings=p4l_settings,
               per_method_for=p4l_per_method, tune_at={"variant": "synergy size x IID", "partitioner": "iid",
                                                       "options.size_dist": "powerlaw"},
               tune_grid=P4L_TUNE_GRID, report=p4l_report,
               baselines="every run is non-private, as in the paper (P4L uses secure aggregation, no DP): no epsilon to equalise",
               eval_set="global"),
        Preset("pdsl", "Wang et al. (PDSL): Table I's grid, epsilon x topology (complete/bipartite/ring) x M (10/20), PDSL vs "
                       "DP-CGA, Muffliato, DP-DPSGD at one certified epsilon; digits at Dirichlet mu 0.25 stands in for MNIST",
               ("digits",), {}, pdsl_variants, PDSL_GROUP_BY, pdsl_claims, settings=pdsl_settings,
               per_method_for=pdsl_per_method, tune_at=PDSL_TUNE_AT, tune_grid=PDSL_TUNE_GRID, report=pdsl_report,
               baselines="every method is private (per-example clipping, Poisson sampling, one accountant) at the "
                         "cell's certified epsilon over the whole run; the paper's epsilon is per round (reference only)",
               eval_set="global"),
    )
}


def describe_presets() -> list[tuple[str, str, str]]:
    """(name, paper datasets, summary) of every preset, for help texts."""
    return [(p.name, ", ".join(p.datasets), p.summary) for p in PRESETS.values()]
