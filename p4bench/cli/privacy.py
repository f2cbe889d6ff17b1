"""`p4bench privacy epsilon|noise|network`: an accountant's epsilon, the noise for a target, or
the pairwise network DP of a gossip method (`p4bench.privacy.network_dp`).

For ``rdp``, ``prv`` and ``pld`` the client is assumed to take part in every round, so
it takes ``rounds x local-steps`` steps at sample rate ``--data-rate`` (no
amplification from client sampling); ``--client-rate``, ``--clients`` and ``--view``
only matter to ``noble``, whose default view is ``aggregator``: in peer-to-peer
learning the receivers see individual updates (``third-party`` is often 2-3x smaller).

``--neighbouring`` gives sigma the meaning it has in runs: std / C for add-remove and
std / (2C) for replace-one. Accountants analyse their native relations directly
(``pld`` both) and convert soundly otherwise (``accounted_epsilon``). The noble bound
is stated for fixed-size sampling without replacement, while runs use Poisson batches.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import typer

from p4bench.errors import ConfigError
from p4bench.host.manager import default_registry

if (
    TYPE_CHECKING
):  # the privacy modules (scipy) are imported by the commands, not when the CLI is built
    from p4bench.privacy.accountants import Accountant, ReleaseSegment

app = typer.Typer(
    name="privacy",
    help="Privacy accounting: epsilon of a training schedule, the noise for a target epsilon, or pairwise network DP.",
    no_args_is_help=True,
)

_ACCOUNTANT = typer.Option(
    "pld",
    "--accountant",
    help="accountant name: pld (default, as in runs) | rdp | prv | noble (see `p4bench list`)",
)
_DATA_RATE = typer.Option(
    ..., "--data-rate", help="data sampling ratio q (or s) per step, in (0, 1]"
)
_LOCAL_STEPS = typer.Option(1, "--local-steps", help="noisy steps K per round")
_ROUNDS = typer.Option(..., "--rounds", help="rounds T")
_CLIENT_RATE = typer.Option(
    1.0, "--client-rate", help="client sampling ratio l per round (noble only)"
)
_CLIENTS = typer.Option(1, "--clients", help="number of clients M (noble, third-party view)")
_VIEW = typer.Option(
    "aggregator",
    "--view",
    help="noble only: aggregator (sigma; P2P receivers see updates) | third-party (sigma*sqrt(l*M))",
)
_NEIGHBOURING = typer.Option(
    "add-remove",
    "--neighbouring",
    help="add-remove (sigma = std/C) | replace-one (sigma = std/(2C)), as in runs; native or soundly converted",
)
_DELTA = typer.Option(..., "--delta", help="target delta, in (0, 1)")
_JSON = typer.Option(
    False, "--json", help="end with one JSON line holding the result and the inputs"
)

NOBLE_CAVEAT = "the noble bound is stated for fixed-size sampling without replacement; runs use Poisson batches"


def _segment(
    noise_multiplier: float,
    data_rate: float,
    local_steps: int,
    rounds: int,
    client_rate: float,
    clients: int,
    view: str,
) -> ReleaseSegment:
    from p4bench.privacy.accountants import ReleaseSegment
    from p4bench.privacy.analysis import check_count

    # checked here so that errors name the flags rather than the derived step count
    check_count("--local-steps", local_steps, minimum=1)
    check_count("--rounds", rounds)
    return ReleaseSegment(
        noise_multiplier=noise_multiplier,
        sample_rate=data_rate,
        steps=rounds * local_steps,
        local_steps=local_steps,
        rounds=rounds,
        client_rate=client_rate,
        clients=clients,
        view=view,
    )


def _inputs(name: str, segment: ReleaseSegment, delta: float, neighbouring: str) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "accountant": name,
        "neighbouring": neighbouring,
        "delta": delta,
        "data_rate": segment.sample_rate,
        "local_steps": segment.local_steps,
        "rounds": segment.total_rounds,
        "steps": segment.steps,
    }
    if name == "noble" or segment.client_rate != 1.0 or segment.clients != 1:
        inputs.update(client_rate=segment.client_rate, clients=segment.clients, view=segment.view)
    if name == "noble":
        inputs["caveat"] = NOBLE_CAVEAT
    return inputs


def _describe(name: str, segment: ReleaseSegment) -> str:
    if name == "noble":
        return (
            f"noble, {segment.view} view: T={segment.total_rounds} rounds at client rate {segment.client_rate:g} "
            f"of M={segment.clients}, K={segment.local_steps} steps at data rate {segment.sample_rate:g}"
        )
    return f"{name}: {segment.steps} steps at sample rate {segment.sample_rate:g}, no client-sampling amplification"


def _relation(acc: Accountant, neighbouring: str) -> str:
    """The relation, and how the accountant reaches it (``accounted_epsilon``)."""
    from p4bench.privacy.accountants import native_relations

    native = native_relations(acc)
    if neighbouring in native:
        return neighbouring
    if "replace-one" in native:
        return f"{neighbouring}, via the replace-one bound at sigma/2"
    return f"{neighbouring}, via group privacy from add-remove at 2 sigma"


def _neighbouring(value: str) -> str:
    from p4bench.privacy.accountants import NEIGHBOURING

    if value not in NEIGHBOURING:
        raise ConfigError(
            "--neighbouring", f"must be one of {', '.join(NEIGHBOURING)}, got {value!r}"
        )
    return value


def epsilon_command(
    accountant: str = _ACCOUNTANT,
    noise_multiplier: float = typer.Option(
        ..., "--noise-multiplier", help="noise multiplier sigma (> 0; see --neighbouring)"
    ),
    data_rate: float = _DATA_RATE,
    local_steps: int = _LOCAL_STEPS,
    rounds: int = _ROUNDS,
    client_rate: float = _CLIENT_RATE,
    clients: int = _CLIENTS,
    view: str = _VIEW,
    delta: float = _DELTA,
    neighbouring: str = _NEIGHBOURING,
    as_json: bool = _JSON,
) -> None:
    """Epsilon spent by one client after `rounds` x `local-steps` noisy steps, for a
    neighbouring relation (sigma = std/C for add-remove, std/(2C) for replace-one)."""
    from p4bench.privacy import get_accountant
    from p4bench.privacy.accountants import accounted_epsilon

    acc = get_accountant(accountant, registry=default_registry())
    neighbouring = _neighbouring(neighbouring)
    segment = _segment(noise_multiplier, data_rate, local_steps, rounds, client_rate, clients, view)
    epsilon = accounted_epsilon(acc, [segment], delta, neighbouring)
    floor = acc.epsilon_floor([segment], delta)
    typer.echo(
        f"epsilon = {epsilon:.4f} at delta = {delta:g}, noise multiplier {noise_multiplier:g}, "
        f"{_relation(acc, neighbouring)} ({_describe(accountant, segment)})"
    )
    _notes(accountant, floor)
    if as_json:
        result = {
            "epsilon": epsilon,
            "noise_multiplier": noise_multiplier,
            **_inputs(accountant, segment, delta, neighbouring),
        }
        if floor > 0:
            result["epsilon_floor"] = floor
        typer.echo(json.dumps(result))


def noise_command(
    epsilon: float = typer.Option(..., "--epsilon", help="target epsilon (> 0)"),
    accountant: str = _ACCOUNTANT,
    data_rate: float = _DATA_RATE,
    local_steps: int = _LOCAL_STEPS,
    rounds: int = _ROUNDS,
    client_rate: float = _CLIENT_RATE,
    clients: int = _CLIENTS,
    view: str = _VIEW,
    delta: float = _DELTA,
    neighbouring: str = _NEIGHBOURING,
    tolerance: float = typer.Option(
        0.01, "--tolerance", help="accept epsilon in [target - tolerance, target]"
    ),
    as_json: bool = _JSON,
) -> None:
    """The smallest noise multiplier (to `tolerance`) whose epsilon stays <= the target,
    for a neighbouring relation (sigma = std/C for add-remove, std/(2C) for replace-one)."""
    from p4bench.privacy import get_accountant
    from p4bench.privacy.accountants import accounted_epsilon
    from p4bench.privacy.calibration import calibrate_accountant

    acc = get_accountant(accountant, registry=default_registry())
    neighbouring = _neighbouring(neighbouring)
    template = _segment(1.0, data_rate, local_steps, rounds, client_rate, clients, view)
    sigma = calibrate_accountant(
        acc,
        [template],
        delta=delta,
        target_epsilon=epsilon,
        tolerance=tolerance,
        neighbouring=neighbouring,
    )
    segment = _segment(sigma, data_rate, local_steps, rounds, client_rate, clients, view)
    achieved = accounted_epsilon(acc, [segment], delta, neighbouring)
    typer.echo(
        f"noise multiplier = {sigma:.4f} gives epsilon = {achieved:.4f} <= {epsilon:g} at delta = {delta:g}, "
        f"{_relation(acc, neighbouring)} ({_describe(accountant, segment)})"
    )
    _notes(accountant, 0.0)
    if as_json:
        result = {
            "noise_multiplier": sigma,
            "epsilon": achieved,
            "target_epsilon": epsilon,
            "tolerance": tolerance,
            **_inputs(accountant, segment, delta, neighbouring),
        }
        typer.echo(json.dumps(result))


def _notes(name: str, floor: float) -> None:
    if floor > 0:
        typer.echo(
            f"note: this bound never goes below epsilon = {floor:.4f} for these parameters, whatever the noise"
        )
    if name == "noble":
        typer.echo(f"note: {NOBLE_CAVEAT}")


def network_command(
    topology: str = typer.Option(..., "--topology", help="topology name (see `p4bench list`)"),
    clients: int = typer.Option(..., "--clients", help="number of nodes M"),
    rounds: int = _ROUNDS,
    epsilon: float | None = typer.Option(
        None, "--epsilon", help="local epsilon of each node's whole schedule (sets the noise)"
    ),
    noise_multiplier: float | None = typer.Option(
        None, "--noise-multiplier", help="noise multiplier sigma (instead of --epsilon)"
    ),
    delta: float = _DELTA,
    method: str = typer.Option("muffliato", "--method", help="muffliato | dp-dsgd"),
    gossip_steps: int | None = typer.Option(
        None, "--gossip-steps", help="muffliato: gossip steps K after each release (default 1)"
    ),
    mixing: str = typer.Option(
        "metropolis", "--mixing", help="metropolis | uniform (directed graphs)"
    ),
    colluders: int = typer.Option(1, "--colluders", help="the worst coalition of K nodes"),
    colluding: str = typer.Option(
        "", "--colluding-nodes", help="a named coalition (comma-separated nodes) joining every v"
    ),
    conversion: str = typer.Option("gdp", "--conversion", help="gdp (exact Gaussian) | rdp"),
    sample_rate: float = typer.Option(
        1.0, "--data-rate", help="Poisson rate of each record in each release (1: full batch)"
    ),
    seed: int = typer.Option(
        0, "--seed", help="seed of random and time-varying graphs, as in runs"
    ),
    as_json: bool = _JSON,
    csv_path: str | None = typer.Option(
        None, "--csv", help="write the matrix epsilon(u -> v) here"
    ),
    heatmap: str | None = typer.Option(
        None, "--heatmap", help="write a heatmap PNG of the matrix here"
    ),
) -> None:
    """Pairwise network DP epsilon(u -> v) of a gossip method on a topology, beside its
    local DP: what node v's view (the messages it receives, its own releases) reveals about
    one record of node u, clipped to local DP (docs/privacy.md, "Network DP")."""
    from p4bench.privacy import get_accountant
    from p4bench.privacy import network_schedule as ns
    from p4bench.privacy.network_dp import summarize
    from p4bench.privacy.network_report import write_heatmap, write_matrix_csv

    if (epsilon is None) == (noise_multiplier is None):
        raise ConfigError("--epsilon", "give exactly one of --epsilon and --noise-multiplier")
    if colluding and colluders != 1:
        raise ConfigError("--colluders", "give either --colluders K or --colluding-nodes, not both")
    try:
        named = [int(w) for w in colluding.split(",")] if colluding else None
    except ValueError:
        raise ConfigError(
            "--colluding-nodes", f"must be comma-separated node numbers, got {colluding!r}"
        ) from None
    if not 0.0 < sample_rate <= 1.0:
        raise ConfigError("--data-rate", f"must be in (0, 1], got {sample_rate}")
    sigma = noise_multiplier or ns.noise_for_local_epsilon(
        float(epsilon or 0), rounds, delta, sample_rate
    )
    schedule = ns.build_schedule(
        method=method, topology=topology, clients=clients, rounds=rounds, noise_multiplier=sigma,
        gossip_steps=gossip_steps, mixing=mixing, seed=seed, sample_rate=sample_rate,
    )  # fmt: skip
    local = ns.local_epsilon(sigma, schedule.releases, delta, sample_rate)
    result = get_accountant("network", registry=default_registry()).pairwise(  # type: ignore[attr-defined]
        schedule.events, clients, delta, colluders=named if named is not None else colluders,
        local_epsilon=local, conversion=conversion,
    )  # fmt: skip
    summary = {**summarize(result, schedule.adjacency), "epsilon_local": local}
    trust = (
        f"coalition {named} + v"
        if named
        else (
            "single curious node v"
            if colluders == 1
            else f"worst coalition of {colluders} nodes ({result.coalition_search})"
        )
    )
    typer.echo(f"network DP of {schedule.description}")
    typer.echo(
        f"noise multiplier {sigma:.4f}, data rate {sample_rate:g}: local epsilon {local:.4f} "
        f"at delta = {delta:g} per node (pld)"
    )
    typer.echo("  ".join(f"{key} = {value:.4f}" for key, value in summary.items()))
    typer.echo(f"trust model: {trust}; relation: {result.relation}")
    typer.echo(f"accountant: {result.accountant}")
    if csv_path:
        typer.echo(f"matrix: {write_matrix_csv(result, csv_path)}")
    if heatmap:
        typer.echo(f"heatmap: {write_heatmap(result, heatmap, schedule.description)}")
    if as_json:
        inputs = dict(method=method, topology=topology, clients=clients, rounds=rounds, delta=delta,
                      gossip_steps=schedule.gossip_steps, mixing=mixing, colluders=result.colluders,
                      conversion=conversion, noise_multiplier=sigma, target_epsilon=epsilon, seed=seed,
                      data_rate=sample_rate)  # fmt: skip
        finite = {
            key: None if math.isnan(value) else value for key, value in summary.items()
        }  # no NaN in JSON
        typer.echo(
            json.dumps({**finite, **inputs, "trust_model": trust, "accountant": result.accountant})
        )


app.command("epsilon")(epsilon_command)
app.command("noise")(noise_command)
app.command("network")(network_command)


def register(root: typer.Typer) -> None:
    """Add the `privacy` command group to the root app."""
    root.add_typer(app, name="privacy")
