"""The run configuration: validated, immutable, resolved from defaults < YAML file < CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from p4bench.config.field_values import check_field
from p4bench.config.field_values import field_meta as _meta  # short: every field's metadata
from p4bench.errors import ConfigError, UsageError

__all__ = ["RunConfig", "resolve_config", "load_config_file"]


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run. Plugins are referred to by registered name."""

    method: str = field(default="p4", metadata=_meta("method to run (see `p4bench list`)"))
    attack: str | None = field(default=None, metadata=_meta("attack plugin, or none"))
    defense: str | None = field(
        default=None,
        metadata=_meta("defense plugin, or none; default: the method's (P4: p4-secure)"),
    )
    dataset: str = field(default="digits", metadata=_meta("dataset plugin"))
    partitioner: str = field(default="iid", metadata=_meta("partitioner plugin"))
    similarity: float = field(
        default=0.5, metadata=_meta("alpha partitioner: fraction of IID data", low=0, high=1)
    )
    clients: int = field(default=20, metadata=_meta("number of clients M", low=2, high=1_000_000))
    samples_per_client: int | None = field(
        default=None,
        metadata=_meta("samples per client R (train+test); default: all data, split evenly", low=2),
    )
    eval_fraction: float = field(
        default=0.2,
        metadata=_meta("fraction of clients used only for tuning, never reported", low=0, high=0.9),
    )
    unseen_fraction: float = field(
        default=0.0,
        metadata=_meta(
            "fraction of clients that join after training (never eval clients): each fine-tunes local_steps "
            "DP steps on its own data from what a newcomer gets; reported apart (accuracy_unseen_*, epsilon_unseen)",
            low=0,
            high=0.9,
        ),
    )
    eval_set: str = field(
        default="personal",
        metadata=_meta(
            "where accuracy is measured: personal (each client's own test split), global (one test set "
            "held out of the dataset before partitioning, never in a client's data; the headline) or both "
            "(both measured, personal the headline)",
            choices=("personal", "global", "both"),
        ),
    )
    hold_out_public: bool = field(
        default=False,
        metadata=_meta(
            "hold out the public pool of a method that reads public data (FedDF's, PDSL's Q: the same "
            "records, seed and -o public_pool) even when this run's method reads none, so that its clients "
            "hold exactly the records they hold in such a run (a like-for-like comparison)"
        ),
    )
    federation_clients: int | None = field(
        default=None,
        metadata=_meta(
            "run on the evaluation clients alone of a federation of this many clients (same seed: same partition "
            "and evaluation clients), `clients` being their number; tuning runs use it so that no reported "
            "client's record takes part (none: the run's own federation)",
            low=2,
            high=1_000_000,
        ),
    )
    rounds: int = field(default=30, metadata=_meta("communication rounds T", low=1, high=1_000_000))
    local_steps: int = field(
        default=5, metadata=_meta("local steps K per round", low=1, high=100_000)
    )
    client_rate: float = field(
        default=1.0, metadata=_meta("client sampling ratio l", low=0, high=1, low_open=True)
    )
    data_rate: float = field(
        default=0.2,
        metadata=_meta("data sampling ratio s (batch = s * n_train)", low=0, high=1, low_open=True),
    )
    lr: float = field(
        default=0.5, metadata=_meta("local step size", low=0, high=1e6, low_open=True)
    )
    global_lr: float = field(
        default=1.0, metadata=_meta("global step size eta_g", low=0, high=1e6, low_open=True)
    )
    malicious_fraction: float = field(
        default=0.3,
        metadata=_meta("fraction of malicious clients under an attack", low=0, high=0.9),
    )
    features: str = field(
        default="raw",
        metadata=_meta(
            "input features: raw pixels or ScatterNet (J=2, L=8)", choices=("raw", "scatter")
        ),
    )
    model: str = field(default="linear", metadata=_meta("model architecture"))
    runtime: str = field(
        default="simulation", metadata=_meta("runtime plugin that executes the method")
    )
    epsilon: float | None = field(
        default=None,
        metadata=_meta(
            "target epsilon per client: sigma is calibrated to it; default: 8 for DP methods, else none (non-private)",
            low=0,
            high=1e6,
            low_open=True,
        ),
    )
    delta: float | None = field(
        default=None,
        metadata=_meta(
            "target delta; default 1/(10 N), N the training records of the data set",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        ),
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata=_meta(
            "DP noise multiplier sigma; default: calibrated from --epsilon",
            low=0,
            high=1e6,
            low_open=True,
        ),
    )
    clip: float = field(
        default=1.0,
        metadata=_meta("DP per-example clipping norm C", low=0, high=1e6, low_open=True),
    )
    neighbouring: str | None = field(
        default=None,
        metadata=_meta(
            "DP neighbouring relation; default: the method's (P4: replace-one)",
            choices=("add-remove", "replace-one"),
        ),
    )
    accountant: str = field(
        default="pld",
        metadata=_meta(
            "privacy accountant used for the budget and calibration (pld: tight for both relations)"
        ),
    )
    no_dp: bool = field(
        default=False,
        metadata=_meta(
            "train a DP method without DP (it is private by default at its default epsilon)"
        ),
    )
    noise_source: str = field(
        default="auto",
        metadata=_meta(
            "DP randomness (noise and Poisson batches): seeded (reproducible, not secret), secure (a secret "
            "generator per client, keyed from the OS CSPRNG), auto (secure where clients are "
            "separate parties, e.g. devices; seeded in simulation)",
            choices=("auto", "seeded", "secure"),
        ),
    )
    noise_generator: str = field(
        default="auto",
        metadata=_meta(
            "seeded DP noise: torch (a CPU generator per client), philox (per-client counter-based streams: the same "
            "numbers on CPU and GPU), auto (torch on the CPU, philox on accelerators)",
            choices=("auto", "torch", "philox"),
        ),
    )
    device_simulation: bool = field(
        default=False,
        metadata=_meta(
            "allow seeded DP randomness on devices (a simulation on devices: epsilon uncertified)"
        ),
    )
    feature_norm: str = field(
        default="sample",
        metadata=_meta(
            "ScatterNet feature normalisation: sample (per-sample group norm, no privacy cost), client (each client's "
            "own statistics, as the P4 paper; outside the ledger: epsilon uncertified), none",
            choices=("sample", "client", "none"),
        ),
    )
    seed: int = field(default=0, metadata=_meta("random seed", low=0, high=2**63 - 1))
    device: str = field(
        default="cpu",
        metadata=_meta(
            "where tensors live: cpu, cuda, cuda:N (one GPU), auto (a GPU where there is one, else cpu)"
        ),
    )
    time_budget_min: float | None = field(
        default=None,
        metadata=_meta(
            "wall-clock budget in minutes: the rounds that finish within it count (the run stops after the first "
            "round that ends past it and reports the round before; checked after every round; none: run every "
            "round)",
            low=0,
            high=1e9,
            low_open=True,
        ),
    )
    memory_budget_gb: float | None = field(
        default=None,
        metadata=_meta(
            "GB the DP step's per-example work may take at once: clients are processed in chunks that fit (the "
            "numbers do not change); none: half the device's free memory. On the device runtime also each "
            "peer's budget for inbound buffers (none: 1 GiB)",
            low=0,
            high=1e6,
            low_open=True,
        ),
    )
    threads: int | None = field(
        default=None,
        metadata=_meta(
            "torch threads of the run, set before training; default: the cores the run may use (all of them "
            "alone, cores // jobs in a sweep, tuning or reproduction with --jobs), at most $OMP_NUM_THREADS where set",
            low=1,
            high=4096,
        ),
    )
    verify: str | None = field(
        default=None,
        metadata=_meta(
            "privacy verification by behaviour: full (the run itself recorded and replayed once at its own size; "
            "the only mode that certifies), stand-in (a 4-client, 2-round federation of the method: not certified) "
            "or off (not certified); none: $P4BENCH_VERIFY, else full",
            choices=("full", "stand-in", "off"),
        ),
    )
    experiment: str = field(default="p4bench", metadata=_meta("MLflow experiment name"))
    tracking_uri: str | None = field(
        default=None, metadata=_meta("MLflow tracking URI; default: local SQLite store")
    )
    results_dir: str = field(
        default="p4bench-runs", metadata=_meta("folder for local copies of every run's results")
    )
    options: Mapping[str, Any] = field(
        default_factory=dict, metadata=_meta("plugin-specific options, for example {'mu': 0.01}")
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_field(f, getattr(self, f.name)))
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def private(self) -> bool:
        """Whether training goes through the DP mechanism (after `runner.resolve_run_config`,
        which applies a DP method's default epsilon)."""
        return not self.no_dp and (self.epsilon is not None or self.noise_multiplier is not None)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON- and YAML-serialisable mapping of every field."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["options"] = dict(self.options)
        return data

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def config_hash(self) -> str:
        """Stable hash of everything that affects results (not where they are logged)."""
        # where results go, how much memory a step may take (chunks change no number), how the privacy
        # claim is checked and how many threads compute it are not results
        ignored = (
            "experiment",
            "tracking_uri",
            "results_dir",
            "memory_budget_gb",
            "verify",
            "threads",
        )
        data = {k: v for k, v in self.to_dict().items() if k not in ignored}
        # added later: runs without them keep their hashes
        for name in ("time_budget_min", "federation_clients"):
            if data[name] is None:
                del data[name]
        # added later: older runs keep their hashes
        for name, default in (
            ("device", "cpu"),
            ("noise_generator", "auto"),
            ("eval_set", "personal"),
            ("hold_out_public", False),
            ("unseen_fraction", 0.0),
        ):
            if data[name] == default:
                del data[name]
        encoded = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]


FIELD_NAMES = tuple(f.name for f in fields(RunConfig))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML run config; keys are RunConfig fields (hyphens or underscores)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of option names to values")
    return _normalise_keys(data, source=str(path))


def _normalise_keys(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise ConfigError(
                str(key), f"unknown option in {source}; valid options: {', '.join(FIELD_NAMES)}"
            )
        out[name] = value
    return out


def resolve_config(
    file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> RunConfig:
    """Defaults < YAML file < explicit overrides (None values in overrides are ignored).

    `options` mappings are merged key by key rather than replaced.
    """
    values: dict[str, Any] = load_config_file(file) if file else {}
    for key, value in _normalise_keys(overrides or {}, source="overrides").items():
        if value is None:
            continue
        if key == "options":
            value = {**dict(values.get("options") or {}), **dict(value)}
        values[key] = value
    return RunConfig(**values)


def parse_key_values(pairs: list[str], flag: str = "--option") -> dict[str, Any]:
    """`KEY=VALUE` command-line pairs as a dict, each value read as YAML (numbers, booleans,
    lists); a pair without `=` or without a key is a `UsageError` naming `flag`."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects KEY=VALUE, got {pair!r}")
        values[key] = yaml.safe_load(value)
    return values
