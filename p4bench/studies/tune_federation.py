"""Which federation tuning runs train on, and what that means for the reported figures' privacy.

Two modes (`tune_on`, `--tune-on`):

- `evaluation-clients` (the default): a tuning run is made of the *evaluation clients
  alone* of the reported federation: the same seed, so the same partition, the same
  train/test splits and the same evaluation clients as a reported run with that seed, and
  none of the other (reported) clients (`RunConfig.federation_clients`,
  `p4bench.data.federated.evaluation_clients_only`). No reported client's record, train
  or test, enters a tuning run, so the chosen values spend none of the reported clients'
  privacy in the runs that share that partition. The run's `clients` is the number of
  evaluation clients: methods, groups, gossip graphs and malicious fractions are built
  for that federation (an attack's malicious fraction is drawn among them).
- `federation`: the whole federation trains in tuning runs (only the reported clients'
  test splits are withheld, `p4bench.studies.backends.WithheldTests`); the reported clients'
  training records take part, so the tuned values are not covered by the privacy
  accounting of the reported runs.

Not built: accounting the tuning itself with the Renyi-DP tuning theorem of Papernot and
Steinke (2022), which would let tuning read reported clients' records at a stated cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from p4bench.config import RunConfig
from p4bench.errors import UsageError

__all__ = [
    "TUNE_ON",
    "DEFAULT_TUNE_ON",
    "check_tune_on",
    "evaluation_clients",
    "tuning_config",
    "tuning_tags",
    "tuning_note",
    "tuning_privacy_line",
    "deltas_text",
    "check_tuning_federation",
]

EVALUATION_CLIENTS = "evaluation-clients"
FEDERATION = "federation"
TUNE_ON = (EVALUATION_CLIENTS, FEDERATION)
DEFAULT_TUNE_ON = EVALUATION_CLIENTS
MIN_CLIENTS = 2  # RunConfig's own lower bound on clients


def check_tune_on(value: Any) -> str:
    """`value` if it names a tuning mode, else UsageError."""
    if value not in TUNE_ON:
        raise UsageError(f"tune_on must be one of {', '.join(TUNE_ON)}, got {value!r}")
    return str(value)


def evaluation_clients(config: RunConfig) -> int:
    """How many evaluation clients a federation of `config.clients` has (as
    `build_federated_data` draws them)."""
    return int(round(config.eval_fraction * config.clients))


def tuning_config(config: RunConfig, tune_on: str) -> RunConfig:
    """The config of a tuning run for a reported run's `config`: with `evaluation-clients`
    its evaluation clients alone, else (`federation`) the config itself. Refuses
    (UsageError) too few evaluation clients to form a federation, or to leave one benign
    client to score under an attack."""
    if check_tune_on(tune_on) == FEDERATION:
        return config
    if config.federation_clients is not None:
        return config  # already a run on evaluation clients
    count = evaluation_clients(config)
    if count < MIN_CLIENTS:
        raise UsageError(
            f"tuning on the evaluation clients alone needs at least {MIN_CLIENTS} of them, but "
            f"eval_fraction={config.eval_fraction:g} of {config.clients} clients gives {count}; "
            f"raise eval_fraction or clients, or tune on the whole federation (--tune-on {FEDERATION})"
        )
    if config.attack is not None and count - int(round(config.malicious_fraction * count)) < 1:
        raise UsageError(
            f"tuning on the {count} evaluation clients alone leaves no benign client to score with "
            f"malicious_fraction={config.malicious_fraction:g}; raise eval_fraction or clients"
        )
    return config.replace(clients=count, federation_clients=config.clients)


def tuning_tags(config: RunConfig, tune_on: str) -> dict[str, str]:
    """MLflow tags of a tuning run (its `config` from `tuning_config`): the mode and the
    federation it trained on."""
    if config.federation_clients is not None:
        federation = f"the {config.clients} evaluation clients of {config.federation_clients} alone"
    else:
        federation = f"all {config.clients} clients (reported clients' training records included)"
    return {"tune_on": tune_on, "tune_federation": federation}


def tuning_note(tune_on: str, configs: Iterable[RunConfig], what: str = "lr") -> str:
    """One line saying how tuning was kept out of (or not) the reported clients' privacy,
    for tuning runs with these configs (from `tuning_config`)."""
    configs = list(configs)
    if check_tune_on(tune_on) == EVALUATION_CLIENTS:
        sizes = sorted({(c.clients, c.federation_clients or c.clients) for c in configs})
        counts = (
            "; ".join(
                f"the {k} evaluation clients alone (disjoint from the {m - k} reported clients)"
                for k, m in sizes
            )
            or "the evaluation clients alone"
        )
        seeds = sorted({c.seed for c in configs})
        seed = (
            f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
            if seeds
            else "its seed"
        )
        return (
            f"{what} tuned on {counts}: tuning spends none of the reported clients' privacy in runs with the "
            f"tuning partition ({seed}; runs at other settings or seeds partition the data anew, and there the "
            "tuning clients' records may belong to reported clients)"
        )
    whole = sorted({c.clients for c in configs})
    counts = ", ".join(map(str, whole)) or "all"
    return (
        f"{what} tuned on the whole federation ({counts} clients; --tune-on {FEDERATION}): the reported "
        f"clients' training records take part, so the tuned {what} is not covered by the privacy accounting"
    )


def deltas_text(runs: Iterable[Any]) -> str:
    """The deltas of the private runs among `runs` (`RunPrivacy`), e.g. "delta 5.6e-05"
    ("" where none is known)."""
    deltas = sorted({r.delta for r in runs if r.private and r.delta is not None})
    return f"delta {', '.join(f'{d:.3g}' for d in deltas)}" if deltas else ""


def tuning_privacy_line(privacy: Any) -> str | None:
    """The tuning runs' own privacy (a `PrivacyCheck` of them), stated apart from the
    reported runs'; None where no tuning run is private."""
    if privacy is None or not any(r.private for r in privacy.runs):
        return None
    delta = deltas_text(privacy.runs)
    return (
        f"tuning runs' own privacy (not reported): {privacy.note().removeprefix('privacy: ')}"
        + (f"; {delta}" if delta else "")
    )


def check_tuning_federation(configs: Sequence[RunConfig], registry: Any = None) -> None:
    """Refuse (UsageError, one line naming the method and the count) tuning runs on
    evaluation clients that a method cannot be built for (P4L's synergies need 3 peers,
    a topology its minimum, an explicit group size more clients): the run's plugins are
    set up once per distinct method and options, before any tuning run trains."""
    from p4bench.errors import ConfigError, IncompatibleError
    from p4bench.host.manager import default_registry
    from p4bench.run.runner import prepare

    registry = registry or default_registry()
    seen: set[str] = set()
    for config in configs:
        if config.federation_clients is None:
            continue
        probe = config.replace(rounds=1)
        key = probe.replace(lr=RunConfig.lr, seed=RunConfig.seed).config_hash()
        if key in seen:
            continue
        seen.add(key)
        try:
            prepare(probe, registry)
        except (ConfigError, IncompatibleError) as exc:
            raise UsageError(
                f"tuning {config.method} on the {config.clients} evaluation clients alone (eval_fraction="
                f"{config.eval_fraction:g} of {config.federation_clients}) is not possible: {exc}; raise "
                f"eval_fraction or clients, or tune on the whole federation (--tune-on {FEDERATION})"
            ) from None
