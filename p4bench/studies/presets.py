"""The presets of `p4bench reproduce`: a paper's experiments as sweep grids, its claims and
its report. A preset is a plugin (`register_presets`), written beside the paper's methods:
P4's five in `p4bench_p4.presets`, Karras et al.'s in
`p4bench_p2p_fl.preset`, PDSL's in `p4bench_pdsl.preset` and P4L's in
`p4bench_p4l.preset`.

This module holds the `Preset` record, the data settings presets share
(`shared/reference/p4.md` section 8; digits is the offline fallback) and the registry.
How presets run, are tuned and checked is `p4bench.studies.reproduce`'s business (see its
docstring for the equal-privacy rules every preset follows: one relation, `RELATION`;
non-private local and centralized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any

from p4bench.moved import forward_moved
from p4bench.studies.claims import ClaimCheck, ClaimContext

__all__ = [
    "DATASETS",
    "FULL",
    "NON_PRIVATE",
    "PRESETS",
    "Preset",
    "QUICK",
    "QUICK_DIGITS",
    "RELATION",
    "alpha_variant",
    "data_settings",
    "describe_presets",
    "presets",
    "shard_variant",
]

# The paper's data settings (p4.md section 8); digits is the offline fallback.
DATASETS: dict[str, dict[str, int]] = {
    "cifar10": {"classes": 10, "clients": 260, "samples_per_client": 200},
    "femnist": {"classes": 47, "clients": 200, "samples_per_client": 300},
    "cifar100": {"classes": 100, "clients": 60, "samples_per_client": 250},
    "digits": {"classes": 10, "clients": 20, "samples_per_client": 80},
    "mnist": {"classes": 10, "clients": 40, "samples_per_client": 100},  # alpha 75%: 119 at most
}
QUICK_DIGITS = {"clients": 10}
FULL: dict[str, Any] = {"rounds": 100, "seeds": (0, 1, 2)}
QUICK: dict[str, Any] = {"rounds": 3, "seeds": (0,)}
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
    tune_at: Mapping[str, Any] = field(
        default_factory=dict
    )  # the setting lr is tuned at (a `variant` or options)
    baselines: str = ""  # which local / centralized baselines are private, and why
    # (dataset, quick) -> base options that replace `DATASETS`'s and the scale's (clients, rounds, ...)
    settings: Callable[[str, bool], Mapping[str, Any]] | None = None
    per_method_for: Callable[[bool], Mapping[str, Mapping[str, Any]]] | None = (
        None  # (quick) -> per_method
    )
    tune_grid: Sequence[float] = ()  # lr candidates; empty: reproduce.TUNE_GRID
    quick_tune_grid: Sequence[float] = ()  # empty: reproduce.QUICK_TUNE_GRID
    # what the paper tunes besides lr (run option -> values), tuned after lr by coordinate
    # search in full runs (`p4bench.studies.tune_axes`); empty: lr alone
    tune_axes: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    tune_budget: int = 20  # the most tuning runs per tuning group, lr's grid included
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
    if quick and dataset in ("digits", "mnist"):
        settings.update(QUICK_DIGITS)
    return settings


def shard_variant(dataset: str, quick: bool, per_client: int) -> dict[str, Any]:
    """Shards with N classes per client at the nearest valid client count (M*N/L integer)."""
    settings = data_settings(dataset, quick)
    classes, clients, samples = (
        settings["classes"],
        settings["clients"],
        settings["samples_per_client"],
    )
    variant: dict[str, Any] = {
        "label": f"shards N={per_client}",
        "partitioner": "shards",
        "options.shards_per_client": per_client,
    }
    if classes:
        step = classes // gcd(classes, per_client)
        variant["clients"] = max(step, int(round(clients / step)) * step)
        variant["samples_per_client"] = samples - samples % per_client
    return variant


def alpha_variant(similarity: float) -> dict[str, Any]:
    return {
        "label": f"alpha {int(round(similarity * 100))}%",
        "partitioner": "alpha",
        "similarity": similarity,
    }


# -- the registry: presets are plugins (`register_presets`) ------------------------


def presets() -> dict[str, Preset]:
    """Every registered preset by name, in registration order: the built-in papers' (each
    beside its methods: P4's in `p4bench_p4.presets`, Karras et al.'s and PDSL's in
    `p4bench_baselines`, P4L's in `p4bench_p4l.preset`) and installed plugins'.
    A name registered twice is refused."""
    from p4bench.errors import PluginError
    from p4bench.host.manager import default_plugin_manager

    found: dict[str, Preset] = {}
    for registered in reversed(
        default_plugin_manager().hook.register_presets()
    ):  # pluggy calls the last first
        for preset in registered:
            if not isinstance(preset, Preset):
                raise PluginError(
                    f"register_presets returned {type(preset).__name__}, not a p4bench.studies.presets.Preset"
                )
            if preset.name in found:
                raise PluginError(f"preset '{preset.name}' is registered twice")
            found[preset.name] = preset
    return found


class _Presets(Mapping[str, Preset]):
    """`PRESETS`: the registered presets, looked up when first read (not when imported)."""

    def _all(self) -> dict[str, Preset]:
        return presets()

    def __getitem__(self, name: str) -> Preset:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


PRESETS: Mapping[str, Preset] = _Presets()


def describe_presets() -> list[tuple[str, str, str]]:
    """(name, paper datasets, summary) of every preset, for help texts."""
    return [(p.name, ", ".join(p.datasets), p.summary) for p in PRESETS.values()]


# P4's preset settings moved beside its methods in 0.2
__getattr__ = forward_moved(
    "p4bench.presets", {"DEFENSES": "p4bench_p4.presets", "EPSILONS": "p4bench_p4.presets"}
)
