"""The post-processing check on a stand-in: does a method send anything but
post-processing of its DP releases?

A method's epsilon holds only if every message it sends is computed from its DP
releases and public values (DESIGN.md's privacy boundary). Declarations cannot show it;
behaviour can. By default the runner checks the run itself at its own size
(`p4bench.privacy.run_verification`); this module is the small check of a *stand-in*
(`--verify stand-in`, the conformance kit): the method runs on a 4-client, 2-round
federation (`check_config`) three times with the same seed (`p4bench.privacy.replay`
has the pieces):

1. *recorded*: every release's value goes on a tape (`p4bench.privacy.tape`), every
   message sent is logged, and every clipped sum is also computed without a random half
   of each client's records (the isolation check's *kept* sums);
2. *replay*: every client's training records are replaced by other records
   (`replaced_records`), and every release is forced to its recorded value. Every
   message must then be bit-identical: one that differs names the round, the exchange,
   the sender, the receiver and the payload entry that read records outside the DP
   mechanism (a non-DP step on a shared model, a mixture with a non-DP personal model,
   training through `ctx.loss_and_grad` without `ctx.dp`, a loss value sent in the clear);
3. *isolation replay* (`p4bench.privacy.isolation`): the changed half of the records
   replaced, the releases forced: the kept sums must not move (a leak *inside* a
   release, where one record moves other records' clipped terms, is hidden by forcing
   the release).

What is not compared is listed in `p4bench.privacy.message_log`. A fused release whose
path does not declare the state it updates (`Releases.state_before`) cannot be forced:
the result says "not verifiable" and the run is uncertified.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p4bench.config import RunConfig
from p4bench.errors import ConfigError, UsageError
from p4bench.privacy.isolation import ChangedRecords
from p4bench.privacy.replay import (
    Recording,
    judge_isolation,
    judge_messages,
    replaced_records,
    run_recorded,
)
from p4bench.privacy.tape import ReleaseTape, ReplayDiverged

__all__ = [
    "PostProcessingResult",
    "check_config",
    "check_post_processing",
    "generic_path",
    "replaced_records",
    "run_check",
    "simulator_options",
]

# The federation the check runs on: small enough for seconds, two rounds so that a
# message computed from the previous round's state is compared too.
CHECK_SIZE: dict[str, Any] = dict(clients=4, rounds=2, local_steps=2, eval_fraction=0.0)


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
    scope: str = "stand-in"  # what ran: "run" (the run itself), "size" (beside it, at its size) or "stand-in"
    cpu_seconds: float = 0.0  # of this process, for the check's own runs

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


def check_config(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """The small federation the check runs `config`'s method on, and notes on what differs.

    Same method, options, model, features, dataset and privacy; `CHECK_SIZE` clients,
    rounds and steps (two rounds even for a one-round run: messages after training count) of its
    own federation (not a tuning run's evaluation clients), no attack, the simulator on the
    CPU with seeded randomness (the two runs must draw the same streams), the fast rdp
    accountant (the check reads no epsilon)."""
    checked = config.replace(
        **CHECK_SIZE,
        federation_clients=None,
        attack=None,
        runtime="simulation",
        device="cpu",
        noise_source="seeded",
        accountant="rdp",
        time_budget_min=None,
        options=simulator_options(config, accountant="rdp"),
    )
    return generic_path(checked)


def simulator_options(config: RunConfig, accountant: str | None = None) -> dict[str, Any]:
    """`config`'s options less those only its own runtime declares (a device run's
    ``device_*`` options), and, where the check swaps in `accountant`, those only the
    run's accountant declares (noble's ``noble_view``): the check's run would refuse them."""
    swaps = [("runtime", config.runtime, "simulation")]
    if accountant is not None and config.private:
        swaps.append(("accountant", config.accountant, accountant))
    swaps = [swap for swap in swaps if swap[1] != swap[2]]
    if not swaps:
        return dict(config.options)
    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.options import declared_options

    registry = Registry(create_plugin_manager())
    names: set[str] = set()
    for kind, used, instead in swaps:
        names |= {o.name for o in declared_options(registry.get(kind, used))}
        names -= {o.name for o in declared_options(registry.get(kind, instead))}
    return {k: v for k, v in config.options.items() if k not in names}


def generic_path(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """`config` as the check runs it, and notes on what differs: unchanged now that fused
    paths declare the state their releases update (`Releases.state_before`), so the
    check runs the path the run takes."""
    return config, []


def check_post_processing(
    config: RunConfig,
    run: Callable[..., Any],
    plugin_manager: Any = None,
    prepare: Callable[[Any], None] | None = None,
) -> PostProcessingResult:
    """Run the check on `config` as given (see `check_config` for the small federation
    the runner uses), with `run` the runner's `p4bench.run.runner.run` (passed in: the
    runner calls this module). `prepare` adjusts each of the prepared runs (tests)."""
    from p4bench.host.manager import create_plugin_manager

    if not config.private:
        raise UsageError(
            "the post-processing check needs a private run: give --epsilon or --noise-multiplier"
        )
    pm = plugin_manager or create_plugin_manager()
    started = time.perf_counter()
    result = PostProcessingResult(config.method, "verified")
    recorded = Recording(ReleaseTape(), ChangedRecords())
    run_recorded(run, config, pm, recorded, data_change="none", prepare=prepare)
    result.releases = len(recorded.tape.values)
    if recorded.tape.unforceable:
        result.status = "not verifiable"
        result.findings.append(
            f"its releases use {', '.join(recorded.tape.unforceable)}, whose value a replay cannot "
            "force; run its generic (unfused) path"
        )
    else:
        if not len(recorded.tape.values) and not recorded.tape.delegated:
            result.notes.append(
                "it made no DP release: every message it sends must then read no record"
            )
        replay = Recording(ReleaseTape(recorded.tape.values), slots=recorded.slots)
        try:
            run_recorded(run, config, pm, replay, data_change="all", prepare=prepare)
        except ReplayDiverged as diverged:
            result.status, result.findings = (
                "failed",
                [f"the releases depend on the replaced records: {diverged}"],
            )
        else:
            judge_messages(result, recorded, replay)
        _check_isolation(run, config, pm, recorded, result, prepare)
    result.seconds = time.perf_counter() - started
    return result


def _check_isolation(
    run: Callable[..., Any],
    config: RunConfig,
    pm: Any,
    recorded: Recording,
    result: PostProcessingResult,
    prepare: Callable[[Any], None] | None,
) -> None:
    """The isolation replay (`p4bench.privacy.isolation`): the changed half of every
    client's records replaced, the releases forced; the kept sums must not move."""
    if not len(recorded.tape.values) or recorded.changed is None or recorded.changed.matched == 0:
        judge_isolation(result, recorded, None)
        return
    replay = Recording(
        ReleaseTape(recorded.tape.values, clean=recorded.tape.clean_values),
        ChangedRecords(),
        recorded.slots,
    )
    try:
        run_recorded(run, config, pm, replay, data_change="changed", prepare=prepare)
    except ReplayDiverged as diverged:
        result.isolation, result.status = "failed", "failed"
        result.findings.append(
            f"record isolation: the releases depend on the changed records: {diverged}"
        )
        return
    judge_isolation(result, recorded, replay)


def run_check(
    config: RunConfig, run: Callable[..., Any], plugin_manager: Any = None
) -> PostProcessingResult:
    """The check at the runner's small size (`check_config`); a method that cannot run
    at that size is checked at its own size with two rounds."""
    checked, notes = check_config(config)
    try:
        result = check_post_processing(checked, run, plugin_manager)
    except (UsageError, ConfigError):
        checked = config.replace(
            rounds=min(config.rounds, 2),
            attack=None,
            runtime="simulation",
            device="cpu",
            noise_source="seeded",
            accountant="rdp",
            time_budget_min=None,
            options=checked.options,
        )
        result = check_post_processing(checked, run, plugin_manager)
        notes.append(
            f"checked at the run's own size ({config.clients} clients): it does not run at {CHECK_SIZE['clients']}"
        )
    result.notes = notes + result.notes
    return result
