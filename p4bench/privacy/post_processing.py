"""The post-processing check: does a method send anything but post-processing of its
DP releases?

A method's epsilon holds only if every message it sends is computed from its DP
releases and public values (DESIGN.md's privacy boundary). Declarations cannot show it;
behaviour can. The check runs the method twice on a small federation, with the same
seed:

1. *recorded*: every release's value goes on a tape (`p4bench.privacy.tape`) and every
   message sent is kept;
2. *replay*: every client's training records are replaced by other records (client
   i gets client i-1's features, reversed, every label changed: `replaced_records`), and every
   release is forced to its recorded value.

Every message must then be bit-identical: a message that differs names the round, the
exchange, the sender, the receiver and the payload entry that read records outside the
DP mechanism (a non-DP step on a shared model, a mixture with a non-DP personal model,
training through `ctx.loss_and_grad` without `ctx.dp`, a loss value sent in the clear).
Replacing *every* client's records at once checks every sender in one replay.

3. *isolation replay* (`p4bench.privacy.isolation`): a leak *inside* a release, where
   one record moves other records' clipped terms (a teacher trained without DP on the
   same records), is hidden by forcing the release. So the recorded run also keeps each
   release's value before noise, with half of every client's records taken out of every
   per-example clipped sum; the third run changes those records, forces the releases,
   and those values must not move. A method that clips whole batches cannot be checked
   this way (its result says "not checked"; post-processing still is).

What is not compared: a node's messages to itself (they never leave it), and, for
central DP (releases `delegate`d to a trusted server), the clients' raw sums addressed
to the server: the server is trusted with them, and its noisy sum is forced like any
release. What cannot be checked: a fused release (`Releases.draw`, computed from raw draws in
the method's own kernel, or `Releases.add_scaled_noise`, whose target may hold state
besides the release): the method's generic path is checked instead where it has one
(P4's ``fused=false``, the same releases), else the result says "not verifiable" and
the run is uncertified.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p4bench.config import RunConfig
from p4bench.engine.messages import BROADCAST, Messages
from p4bench.engine.network import Network, ObservedNetwork
from p4bench.errors import ConfigError, UsageError
from p4bench.privacy.isolation import ChangedRecords, changed_slots, excluding, features_at, with_changed_records
from p4bench.privacy.tape import ReleaseTape, ReplayDiverged, using_tape
from p4bench.rng import SERVER_ID

__all__ = [
    "PostProcessingResult", "check_config", "check_post_processing", "generic_path", "replaced_records",
    "run_check",
]

# The federation the check runs on: small enough for seconds, two rounds so that a
# message computed from the previous round's state is compared too.
CHECK_SIZE: dict[str, Any] = dict(clients=4, rounds=2, local_steps=2, eval_fraction=0.0)
MAX_FINDINGS = 1  # differing messages named in the result; a count says how many more


@dataclass
class PostProcessingResult:
    """The verdict of one check.

    `status` is "verified" (every compared message identical), "failed" (`findings`
    name the messages) or "not verifiable" (`findings` say why)."""

    method: str
    status: str
    findings: list[str] = field(default_factory=list)
    releases: int = 0
    messages: int = 0  # messages compared
    exempt: int = 0  # a node's messages to itself, and raw sums to a trusted server
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    isolation: str = "not run"  # the isolation replay: verified, failed, not checked or not run

    @property
    def passed(self) -> bool:
        return self.status == "verified"

    def reason(self) -> str | None:
        """One line for the run's certification (None when verified)."""
        if self.passed:
            return None
        return f"post-processing check {self.status} for method '{self.method}': {'; '.join(self.findings)}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Exchange:
    exchange: str
    phase: str
    round_index: int
    src: torch.Tensor
    dst: torch.Tensor
    payload: dict[str, torch.Tensor]


def replaced_records(train: Any, num_classes: int) -> Any:
    """Other training records of the same counts: client i gets the features of client
    i-1's padded records in reverse order, and every label moves to the next class."""
    from p4bench.data.federated import ClientTensors

    x = train.x.roll(1, dims=0).flip(1).contiguous()
    y = ((train.y + 1) % max(int(num_classes), 1)).contiguous()  # every label changes
    return ClientTensors(x, y, train.n.clone())


def check_config(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """The small federation the check runs `config`'s method on, and notes on what differs.

    Same method, options, model, features, dataset and privacy; `CHECK_SIZE` clients,
    rounds and steps (two rounds even for a one-round run: messages after training count) of its
    own federation (not a tuning run's evaluation clients), no attack, the simulator on the
    CPU with seeded randomness (the two runs must draw the same streams), the fast rdp
    accountant (the check reads no epsilon)."""
    checked = config.replace(**CHECK_SIZE, federation_clients=None, attack=None, runtime="simulation", device="cpu",
                             noise_source="seeded", accountant="rdp", time_budget_min=None,
                             options=_simulator_options(config))
    return generic_path(checked)


def _simulator_options(config: RunConfig) -> dict[str, Any]:
    """`config`'s options less those only its own runtime declares (a device run's
    ``device_*`` options): the check runs on the simulator, which would refuse them."""
    if config.runtime == "simulation":
        return dict(config.options)
    from p4bench.options import declared_options
    from p4bench.plugin_manager import Registry, create_plugin_manager

    registry = Registry(create_plugin_manager())
    names = {o.name for o in declared_options(registry.get("runtime", config.runtime))}
    names -= {o.name for o in declared_options(registry.get("runtime", "simulation"))}
    return {k: v for k, v in config.options.items() if k not in names}


def generic_path(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """`config` on the method's generic release path where its default path is fused
    (releases computed from raw draws cannot be forced), and a note saying so."""
    if config.method == "p4" and config.options.get("fused") not in (False, "off"):
        return config.replace(options={**config.options, "fused": False}), [
            "p4 checked with -o fused=false: its fused kernels compute a release from raw draws, which a replay "
            "cannot force (the same releases, unfused)"]
    return config, []


def check_post_processing(config: RunConfig, run: Callable[..., Any], plugin_manager: Any = None,
                          prepare: Callable[[Any], None] | None = None) -> PostProcessingResult:
    """Run the check on `config` as given (see `check_config` for the small federation
    the runner uses), with `run` the runner's `p4bench.run.runner.run` (passed in: the
    runner calls this module). `prepare` adjusts each of the two prepared runs (tests)."""
    from p4bench.plugin_manager import create_plugin_manager

    if not config.private:
        raise UsageError("the post-processing check needs a private run: give --epsilon or --noise-multiplier")
    pm = plugin_manager or create_plugin_manager()
    started = time.perf_counter()
    result = PostProcessingResult(config.method, "verified")
    recorded_tape, changed = ReleaseTape(), ChangedRecords()
    recorded = _run(run, config, pm, recorded_tape, data_change="none", prepare=prepare, changed=changed)
    result.releases = len(recorded_tape.values)
    if recorded_tape.unforceable:
        result.status = "not verifiable"
        result.findings.append(f"its releases use {', '.join(recorded_tape.unforceable)}, whose value a replay cannot "
                               "force; run its generic (unfused) path")
    else:
        if not recorded_tape.values and not recorded_tape.delegated:
            result.notes.append("it made no DP release: every message it sends must then read no record")
        replay_tape = ReleaseTape(recorded_tape.values)
        try:
            replayed = _run(run, config, pm, replay_tape, data_change="all", prepare=prepare)
        except ReplayDiverged as diverged:
            result.status, result.findings = "failed", [f"the releases depend on the replaced records: {diverged}"]
        else:
            if not replay_tape.finished:
                result.status = "failed"
                result.findings.append(f"the replay made {replay_tape.position} of the {len(recorded_tape.values)} "
                                       "recorded releases: which releases it makes depends on the records")
            compared, exempt, differences = _compare(recorded, replayed, central=recorded_tape.delegated > 0)
            result.messages, result.exempt = compared, exempt
            if differences:
                result.status = "failed"
                extra = len(differences) - MAX_FINDINGS
                result.findings += differences[:MAX_FINDINGS] + ([f"{extra} more message(s) differ"] if extra > 0 else [])
        if result.status != "not verifiable":
            _check_isolation(run, config, pm, recorded_tape, changed, result, prepare)
    result.seconds = time.perf_counter() - started
    return result


def _check_isolation(run: Callable[..., Any], config: RunConfig, pm: Any, recorded_tape: ReleaseTape,
                     changed: ChangedRecords, result: PostProcessingResult,
                     prepare: Callable[[Any], None] | None) -> None:
    """The isolation replay (`p4bench.privacy.isolation`): half of every client's records
    changed, their own terms out of every clipped sum, the releases forced; the sums before
    noise must not move. Adds its findings (and the status "failed") to `result`."""
    if not recorded_tape.values:
        return
    if changed.matched == 0:
        result.isolation = "not checked"
        result.notes.append("record isolation not checked: no changed record was found in a per-example clipped batch "
                            "(`clipped_gradient_sum`): the method clips whole batches, clips on its own, or transforms "
                            "its inputs first")
        return
    tape = ReleaseTape(recorded_tape.values, clean=recorded_tape.clean_values)
    try:
        _run(run, config, pm, tape, data_change="changed", prepare=prepare, changed=ChangedRecords())
    except ReplayDiverged as diverged:
        result.isolation, result.status = "failed", "failed"
        result.findings.append(f"record isolation: the releases depend on the changed records: {diverged}")
        return
    if tape.clean_differences:
        result.isolation, result.status = "failed", "failed"
        extra = len(tape.clean_differences) - MAX_FINDINGS
        result.findings.append(
            "record isolation: " + "; ".join(tape.clean_differences[:MAX_FINDINGS])
            + (f" ({extra} more)" if extra > 0 else "") + " with half of each client's records changed and their own "
            "terms in no sum: a record moves other records' clipped terms, outside the per-record sensitivity the "
            "ledger accounts")
    else:
        result.isolation = "verified"


def _run(run: Callable[..., Any], config: RunConfig, pm: Any, tape: ReleaseTape, *, data_change: str,
         prepare: Callable[[Any], None] | None, changed: ChangedRecords | None = None) -> list[_Exchange]:
    """One run of the check, its messages kept: `data_change` "none" (the recorded run),
    "all" (every training record replaced) or "changed" (the isolation replay's records
    replaced); with `changed`, the isolation replay's records are in no clipped sum."""
    log: list[_Exchange] = []

    def keep(exchange: str, phase: str, round_index: int, outgoing: Messages) -> None:
        payload = {k: v.detach().cpu().clone() for k, v in outgoing.payload.items()}
        log.append(_Exchange(exchange, phase, round_index, outgoing.src.cpu().clone(), outgoing.dst.cpu().clone(),
                             payload))

    def on_prepared(prepared: Any) -> None:
        if prepare is not None:
            prepare(prepared)
        runtime = prepared.runtime
        if not hasattr(runtime, "network"):
            raise UsageError(f"runtime '{config.runtime}' has no in-process network to observe; check on the simulation")
        inner = runtime.network

        def network() -> Network:
            return ObservedNetwork(inner(), keep)

        runtime.network = network
        data = prepared.job.data
        replacement = replaced_records(data.train, data.num_classes)
        train = data.train
        slots = changed_slots(data.train, replacement)  # the isolation replay's records (same data: same slots)
        if data_change == "all":
            train = replacement
        elif data_change == "changed":
            train = with_changed_records(data.train, replacement, slots)
        if changed is not None:
            changed.features = features_at(train, slots)
        if train is not data.train:
            prepared.job.data = dataclasses.replace(data, train=train)

    with using_tape(tape), excluding(changed or ChangedRecords()):
        run(config, plugin_manager=pm, track=False, on_prepared=on_prepared, verify=False)
    return log


def _compare(recorded: list[_Exchange], replayed: list[_Exchange], *, central: bool) -> tuple[int, int, list[str]]:
    """(messages compared, messages exempt, one line per differing message)."""
    if len(recorded) != len(replayed):
        return 0, 0, [f"the replay made {len(replayed)} exchanges, the recorded run {len(recorded)}: the schedule "
                      "depends on the records"]
    compared = exempt = 0
    differences: list[str] = []
    for a, b in zip(recorded, replayed):
        where = f"phase '{a.phase}' round {a.round_index}, exchange '{a.exchange}'"
        if (a.exchange, a.phase, a.round_index) != (b.exchange, b.phase, b.round_index):
            return compared, exempt, differences + [f"{where}: the replay ran exchange '{b.exchange}' there instead"]
        if not (torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)):
            differences.append(f"{where}: the replay sent to other nodes (who talks to whom depends on the records)")
            continue
        if sorted(a.payload) != sorted(b.payload):
            differences.append(f"{where}: payload entries {sorted(b.payload)} on the replay, {sorted(a.payload)} recorded")
            continue
        skip = a.src == a.dst
        if central:  # the trusted server's raw input
            skip |= (a.dst == SERVER_ID) & (a.src != SERVER_ID)
        exempt += int(skip.sum())
        compared += int((~skip).sum())
        for i in torch.nonzero(~skip).flatten().tolist():
            for key in sorted(a.payload):
                x, y = a.payload[key][i], b.payload[key][i]
                if not torch.equal(x, y):
                    gap = (x.double() - y.double()).abs().nan_to_num(float("inf")).max() if x.numel() else 0.0
                    differences.append(f"{where}: message {_node(int(a.src[i]))} -> {_node(int(a.dst[i]))} "
                                       f"'{key}' differs by up to {float(gap):.3g}")
                    break
    return compared, exempt, differences


def _node(node: int) -> str:
    return "server" if node == SERVER_ID else "every client" if node == BROADCAST else f"client {node}"


def run_check(config: RunConfig, run: Callable[..., Any], plugin_manager: Any = None) -> PostProcessingResult:
    """The check at the runner's small size (`check_config`); a method that cannot run
    at that size is checked at its own size with two rounds."""
    checked, notes = check_config(config)
    try:
        result = check_post_processing(checked, run, plugin_manager)
    except (UsageError, ConfigError):
        checked = config.replace(rounds=min(config.rounds, 2), attack=None, runtime="simulation", device="cpu",
                                 noise_source="seeded", accountant="rdp", time_budget_min=None,
                                 options=checked.options)
        result = check_post_processing(checked, run, plugin_manager)
        notes.append(f"checked at the run's own size ({config.clients} clients): it does not run at {CHECK_SIZE['clients']}")
    result.notes = notes + result.notes
    return result
