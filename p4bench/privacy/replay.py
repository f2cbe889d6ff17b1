"""The pieces every post-processing check is made of: a recorded run, a replay, a verdict.

A *recording* is one run of a method with its releases on a tape (`p4bench.privacy.tape`),
its messages logged (`p4bench.privacy.message_log`) and, for the record-isolation check,
the kept clipped sums of a random half of every client's records (`p4bench.privacy.isolation`).
A *replay* runs the same configuration again with some records replaced and every release
forced to its recorded value. The verdict compares the two:

- every message identical (else a record was read outside the DP mechanism);
- the same releases in the same order (else which releases are made depends on records);
- with the changed half of the records replaced, every kept clipped sum identical (else
  a record moved other records' clipped terms inside a release).

The stand-in check (`p4bench.privacy.post_processing`) records a small federation and
replays it twice (every record replaced, then the changed half); the run-size check
(`p4bench.privacy.run_verification`) records the run itself and replays it once, with
the changed half replaced, which answers both questions in one extra pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from p4bench.errors import UsageError
from p4bench.privacy.isolation import (
    ChangedRecords,
    changed_slots,
    excluding,
    features_at,
    with_changed_records,
)
from p4bench.privacy.message_log import MessageLog, compare_logs
from p4bench.privacy.network_mixing import MixingCheck
from p4bench.privacy.tape import ReleaseTape, using_tape

__all__ = [
    "Recording",
    "instrument",
    "judge_isolation",
    "judge_messages",
    "replaced_records",
    "replaying",
    "run_recorded",
]

_REPLAYING: ContextVar[bool] = ContextVar("p4bench_replaying", default=False)

MAX_FINDINGS = 1  # differing messages named in a result; a count says how many more
DATA_CHANGES = ("none", "all", "changed")


def replaced_records(train: Any, num_classes: int) -> Any:
    """Other training records of the same counts: client i gets the features of client
    i-1's padded records in reverse order, each mirrored along its last axis (so that a
    replacement seldom equals any record of the data: the isolation check keeps those
    that do unchanged), and every label moves to the next class."""
    from p4bench.data.federated import ClientTensors

    x = train.x.roll(1, dims=0).flip(1).flip(-1).contiguous()
    y = ((train.y + 1) % max(int(num_classes), 1)).contiguous()  # every label changes
    return ClientTensors(x, y, train.n.clone())


@dataclass
class Recording:
    """One run of a check: its tape, its message log, and the changed records (None: no
    kept sums are computed) at `slots` ((C, n_max) bool, drawn by the recorded run)."""

    tape: ReleaseTape
    changed: ChangedRecords | None = None
    slots: torch.Tensor | None = None
    log: MessageLog = field(init=False)
    attackers: torch.Tensor | None = None  # (M,) bool: the clients an attack controls
    mixing: MixingCheck | None = None  # the recorded run's network mixing check

    def __post_init__(self) -> None:
        self.log = MessageLog(self.tape)


def instrument(prepared: Any, recording: Recording, data_change: str, seed: int) -> None:
    """Make `prepared` (a `PreparedRun`) the run `recording` records: its network logged, its
    training records changed as `data_change` says ("none", "all" or "changed": the
    slots the recording has, else a random half drawn from `seed`), its changed records
    known to the isolation check."""
    if data_change not in DATA_CHANGES:
        raise ValueError(f"data_change must be one of {DATA_CHANGES}")
    runtime = prepared.runtime
    if not hasattr(runtime, "network"):
        raise UsageError(
            f"runtime '{prepared.config.runtime}' has no in-process network to observe; check on the "
            "simulation"
        )
    runtime.network = recording.log.wrap(runtime.network)
    if data_change == "none" and not prepared.config.attack:  # the recorded run: check the mixing
        recording.mixing = MixingCheck(prepared.job.method, prepared.job.method.num_clients)
        recording.tape.observers.append(recording.mixing.on_release)
        runtime.network = observed(runtime.network, recording.mixing.on_send)
    recording.attackers = torch.as_tensor(prepared.info.malicious, dtype=torch.bool).cpu()
    data = prepared.job.data
    replacement = replaced_records(data.train, data.num_classes)
    if recording.slots is None:
        recording.slots = changed_slots(data.train, replacement, seed)
    train = data.train
    if data_change == "all":
        train = replacement
    elif data_change == "changed":
        train = with_changed_records(data.train, replacement, recording.slots)
    if recording.changed is not None:
        recording.changed.use(features_at(train, recording.slots))
    if train is not data.train:
        prepared.job.data = dataclasses.replace(data, train=train)


def observed(inner: Callable[[], Any], on_send: Callable[..., None]) -> Callable[[], Any]:
    """A runtime's `network` factory whose networks show every exchange to `on_send`."""
    from p4bench.engine.network import ObservedNetwork

    return lambda: ObservedNetwork(inner(), on_send)


def judge_mixing(result: Any, recorded: Recording) -> None:
    """Add to `result` what the network mixing check of the recorded run found."""
    mixing = recorded.mixing
    if mixing is None or not mixing.declared:
        return
    if mixing.findings:
        result.status = "failed"
        result.findings.append(f"network mixing: {mixing.findings[0]}")
    else:
        result.notes.append(
            f"network mixing verified: {mixing.checked} gossip messages equal their senders' "
            "declared states"
        )


def judge_messages(result: Any, recorded: Recording, replay: Recording) -> None:
    """Add to `result` (a `PostProcessingResult`) what the replay's releases and messages
    say against the recorded run's (and the recorded run's network mixing check)."""
    result.releases = len(recorded.tape.values)
    if not replay.tape.finished:
        result.status = "failed"
        result.findings.append(
            f"the replay made {replay.tape.position} of the {len(recorded.tape.values)} recorded "
            "releases: which releases it makes depends on the records"
        )
    if replay.tape.before_differences:
        result.status = "failed"
        extra = len(replay.tape.before_differences) - MAX_FINDINGS
        result.findings += replay.tape.before_differences[:MAX_FINDINGS] + (
            [f"{extra} more fused release(s) differ before"] if extra > 0 else []
        )
    compared, exempt, differences = compare_logs(
        recorded.log.exchanges,
        replay.log.exchanges,
        central=recorded.tape.delegated > 0,
        attackers=recorded.attackers,
    )
    result.messages, result.exempt = compared, exempt
    if differences:
        result.status = "failed"
        extra = len(differences) - MAX_FINDINGS
        result.findings += differences[:MAX_FINDINGS] + (
            [f"{extra} more message(s) differ"] if extra > 0 else []
        )
    judge_mixing(result, recorded)  # after the replay's findings: a record read outside DP first


def judge_isolation(result: Any, recorded: Recording, replay: Recording | None) -> None:
    """Add to `result` what the kept clipped sums say (`replay` None: it was not run,
    because no changed record met a clipped sum or the method made no release)."""
    changed = recorded.changed
    if not len(recorded.tape.values):
        return
    if changed is None or changed.matched == 0 or replay is None:
        result.isolation = "not checked"
        result.notes.append(
            "record isolation not checked: no changed record was found in a per-example clipped batch "
            "(`clipped_gradient_sum`): the method clips whole batches, clips on its own, or transforms "
            "its inputs first"
        )
        return
    tape = replay.tape
    differences = list(tape.clean_differences)
    if tape.clean_position < len(recorded.tape.clean_values):
        differences.append(
            f"the replay computed {tape.clean_position} of the {len(recorded.tape.clean_values)} recorded "
            "clipped sums"
        )
    if differences:
        result.isolation, result.status = "failed", "failed"
        extra = len(differences) - MAX_FINDINGS
        result.findings.append(
            "record isolation: "
            + "; ".join(differences[:MAX_FINDINGS])
            + (f" ({extra} more)" if extra > 0 else "")
            + " with half of each client's records changed and their own terms in no kept sum: a record moves other "
            "records' clipped terms, outside the per-record sensitivity the ledger accounts"
        )
        return
    checked = recorded.tape.kept_checked
    if all(checked):
        result.isolation = "verified"
        return
    result.isolation = "partly checked"
    result.notes.append(
        f"record isolation checked for {sum(checked)} of the {len(checked)} releases: the others clip "
        "inside their own kernels (such as P4's span path), which report no kept clipped sums"
    )


def run_recorded(
    run: Callable[..., Any],
    config: Any,
    pm: Any,
    recording: Recording,
    *,
    data_change: str,
    prepare: Callable[[Any], None] | None = None,
    **run_options: Any,
) -> Any:
    """Run `config` with `run` (the runner's), recording into `recording`."""

    def on_prepared(prepared: Any) -> None:
        if prepare is not None:
            prepare(prepared)
        instrument(prepared, recording, data_change, config.seed)

    token = _REPLAYING.set(True)
    try:
        with (
            using_tape(recording.tape),
            excluding(recording.changed) if recording.changed is not None else nullcontext(),
        ):
            return run(
                config,
                plugin_manager=pm,
                track=False,
                on_prepared=on_prepared,
                verify=False,
                **run_options,
            )
    finally:
        _REPLAYING.reset(token)


def replaying() -> bool:
    """Whether the run in this context is one of a privacy check's (a progress display says so)."""
    return _REPLAYING.get()
