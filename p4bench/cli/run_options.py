"""`p4bench run`'s options, declared once: `RunOptions` holds each option's name, type,
default and help, and the command's parameters are built from it (`command_signature`), so
the command receives them as one typed object.

An option that sets a `RunConfig` field takes that field's help text (`config_help`): one
text per option, shown by `--help`, in docs/options.md and for YAML files alike. Options
default to None so that a `--config` file can set them; `show_config_defaults` shows the
config's defaults in `--help`. This module has no `from __future__ import annotations`: the
typer markers in the annotations are built once, here, and `--help` defaults are set on them.
"""

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_args

import typer

from p4bench.cli.completion import completer
from p4bench.config import RunConfig, parse_key_values
from p4bench.errors import UsageError

__all__ = [
    "CONFIG_FIELDS",
    "RunOptions",
    "command_signature",
    "config_help",
    "show_config_defaults",
    "topology_overrides",
]

# options named otherwise than the RunConfig field they set (the rest share its name)
CONFIG_FIELDS = {"time_budget": "time_budget_min", "memory_budget": "memory_budget_gb"}
# flags whose False means "not given" (the config's, or the file's, value then holds)
_FLAGS = ("no_dp", "device_simulation", "hold_out_public")


def config_help(name: str) -> str:
    """The help text of `RunConfig` field `name` (the one text of the option that sets it)."""
    text: str = RunConfig.__dataclass_fields__[name].metadata["help"]
    return text


def _opt(name: str, *decls: str, **kwargs: Any) -> Any:
    """A typer option whose help is the text of RunConfig field `name`."""
    return typer.Option(*decls, help=config_help(name), **kwargs)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Every option of `p4bench run`, as given (None: not given)."""

    method: Annotated[str | None, _opt("method", autocompletion=completer("method"))] = None
    attack: Annotated[str | None, _opt("attack", autocompletion=completer("attack"))] = None
    defense: Annotated[str | None, _opt("defense", autocompletion=completer("defense"))] = None
    dataset: Annotated[str | None, _opt("dataset", autocompletion=completer("dataset"))] = None
    partitioner: Annotated[
        str | None, _opt("partitioner", autocompletion=completer("partitioner"))
    ] = None
    similarity: Annotated[float | None, _opt("similarity")] = None
    clients: Annotated[int | None, _opt("clients")] = None
    samples_per_client: Annotated[int | None, _opt("samples_per_client")] = None
    rounds: Annotated[int | None, _opt("rounds")] = None
    local_steps: Annotated[int | None, _opt("local_steps")] = None
    client_rate: Annotated[float | None, _opt("client_rate")] = None
    data_rate: Annotated[float | None, _opt("data_rate")] = None
    lr: Annotated[float | None, _opt("lr")] = None
    global_lr: Annotated[float | None, _opt("global_lr")] = None
    malicious_fraction: Annotated[float | None, _opt("malicious_fraction")] = None
    epsilon: Annotated[float | None, _opt("epsilon")] = None
    no_dp: Annotated[bool, _opt("no_dp", "--no-dp")] = False
    delta: Annotated[float | None, _opt("delta")] = None
    noise_multiplier: Annotated[float | None, _opt("noise_multiplier")] = None
    clip: Annotated[float | None, _opt("clip")] = None
    neighbouring: Annotated[str | None, _opt("neighbouring")] = None
    accountant: Annotated[str | None, _opt("accountant")] = None
    noise_source: Annotated[str | None, _opt("noise_source")] = None
    noise_generator: Annotated[str | None, _opt("noise_generator")] = None
    device_simulation: Annotated[bool, _opt("device_simulation", "--device-simulation")] = False
    feature_norm: Annotated[str | None, _opt("feature_norm")] = None
    eval_fraction: Annotated[float | None, _opt("eval_fraction")] = None
    unseen_fraction: Annotated[float | None, _opt("unseen_fraction")] = None
    eval_set: Annotated[str | None, _opt("eval_set", "--eval")] = None
    hold_out_public: Annotated[bool, _opt("hold_out_public", "--hold-out-public")] = False
    features: Annotated[str | None, _opt("features")] = None
    shards_per_client: Annotated[
        int | None, typer.Option(help="shards partitioner: classes per client N")
    ] = None
    model: Annotated[str | None, _opt("model", autocompletion=completer("model"))] = None
    runtime: Annotated[str | None, _opt("runtime", autocompletion=completer("runtime"))] = None
    topology: Annotated[
        str | None,
        typer.Option(
            "--topology",
            help="communication graph of a method that sends over one (a topology plugin: ring, "
            "complete, exponential, ...; `p4bench describe METHOD` says whether and which)",
            autocompletion=completer("topology"),
        ),
    ] = None
    topology_option: Annotated[
        list[str],
        typer.Option(
            "--topology-option",
            metavar="KEY=VALUE",
            help="an option of --topology's graph, e.g. k=4 (repeatable)",
        ),
    ] = field(default_factory=list)
    local_peers: Annotated[
        int | None,
        typer.Option(
            help="device runtime: N peer processes on 127.0.0.1 (sets --runtime device and "
            "--clients N)"
        ),
    ] = None
    seed: Annotated[int | None, _opt("seed")] = None
    device: Annotated[str | None, _opt("device")] = None
    time_budget: Annotated[
        float | None, _opt("time_budget_min", "--time-budget", metavar="MINUTES")
    ] = None
    memory_budget: Annotated[
        float | None, _opt("memory_budget_gb", "--memory-budget", metavar="GB")
    ] = None
    verify: Annotated[str | None, _opt("verify", "--verify")] = None
    threads: Annotated[int | None, _opt("threads", metavar="N")] = None
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML file of run options (CLI options win)")
    ] = None
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN_ID_OR_DIR",
            help="continue an interrupted run from its last checkpoint: its results folder, local "
            "run id or MLflow run id (with --results-dir / --tracking-uri where not the defaults); "
            "no other run options. The run goes on in the same folder and MLflow run and ends as "
            "the uninterrupted run would (seeded randomness). A finished run is not run again: one "
            "line says so, exit 0",
        ),
    ] = None
    experiment: Annotated[str | None, _opt("experiment")] = None
    tracking_uri: Annotated[str | None, _opt("tracking_uri")] = None
    results_dir: Annotated[str | None, _opt("results_dir")] = None
    option: Annotated[
        list[str], typer.Option("--option", "-o", help="plugin option KEY=VALUE (repeatable)")
    ] = field(default_factory=list)
    as_json: Annotated[
        bool, typer.Option("--json", help="print the summary as one JSON object on the last line")
    ] = False

    def with_local_peers(self) -> "RunOptions":
        """`--local-peers N`, the device plugin's local mode (one client per peer process), as
        the options it stands for: `--runtime device`, `--clients N` and the peers option."""
        if self.local_peers is None:
            return self
        if self.runtime not in (None, "device"):
            raise UsageError(
                f"--local-peers runs the device runtime; it cannot be combined with --runtime "
                f"{self.runtime}"
            )
        return dataclasses.replace(
            self,
            runtime=self.runtime or "device",
            clients=self.clients or self.local_peers,
            option=[*self.option, f"device_local_peers={self.local_peers}"],
        )

    def overrides(self) -> dict[str, Any]:
        """The run options given on the command line, as `RunConfig` fields."""
        given = self.shards_per_client  # 0 too: the partitioner's own check refuses it
        plugin_options = {
            **({"shards_per_client": given} if given is not None else {}),
            **parse_key_values(self.option),
        }
        plugin_options.update(
            topology_overrides(self.topology, self.topology_option, plugin_options)
        )
        fields = {f.name for f in dataclasses.fields(RunConfig)}
        values: dict[str, Any] = {
            CONFIG_FIELDS.get(f.name, f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if CONFIG_FIELDS.get(f.name, f.name) in fields and f.name != "options"
        }
        values.update({flag: getattr(self, flag) or None for flag in _FLAGS})
        values["options"] = plugin_options or None
        return {k: v for k, v in values.items() if v is not None}


def topology_overrides(
    name: str | None, pairs: list[str], options: dict[str, Any]
) -> dict[str, Any]:
    """`--topology` and `--topology-option` as the method's options `topology` and
    `topology_options` (those of `p4bench.options.topology_options`); refused when `-o`
    sets the same option too."""
    given: dict[str, Any] = {}
    if name is not None:
        given["topology"] = name
    if pairs:
        given["topology_options"] = parse_key_values(pairs, flag="--topology-option")
    for key, flag in (("topology", "--topology"), ("topology_options", "--topology-option")):
        if key in given and key in options:
            raise UsageError(f"{flag} and -o {key}=... both set the topology; give one")
    return given


def _option_info(f: dataclasses.Field[Any]) -> typer.models.OptionInfo:
    info: typer.models.OptionInfo = next(
        a for a in get_args(f.type) if isinstance(a, typer.models.OptionInfo)
    )
    return info


def _default(f: dataclasses.Field[Any]) -> Any:
    factory = f.default_factory
    return factory() if callable(factory) else f.default


def command_signature() -> inspect.Signature:
    """The typer command's parameters: one per `RunOptions` field, keyword-only."""
    return inspect.Signature(
        [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=f.type,
                default=_default(f),
            )
            for f in dataclasses.fields(RunOptions)
        ]
    )


def show_config_defaults(config: RunConfig | None = None) -> None:
    """Show the run's real defaults in `--help`: options default to None (so that a
    `--config` file can set them) and typer would show nothing; take each one's default
    from the `RunConfig` field it sets, where it has one."""
    base = config or RunConfig()
    for f in dataclasses.fields(RunOptions):
        value = getattr(base, CONFIG_FIELDS.get(f.name, f.name), None)
        shown = value is not None and value is not False and not isinstance(value, dict)
        if f.default is None and shown:
            _option_info(f).show_default = str(value)
