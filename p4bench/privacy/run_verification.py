"""The post-processing check at the run's own size, on the run itself.

`--verify full` (the default) checks the configuration that ran, not a stand-in: the run
is the recorded run (its releases on a tape, its messages logged as fingerprints, the
kept clipped sums of a random half of every client's records computed beside its own,
`p4bench.privacy.replay`), and after its last round one replay runs the same
configuration (clients, rounds, steps, options, data, model, attack) with that half of
the records replaced and every release forced. That one extra pass answers both
questions: every message must be identical (post-processing) and every kept clipped
sum must be identical (record isolation). A leak that starts in round 20, appears only
at 200 clients or lives in a helper module is met where it happens.

The run can be its own recording only where a replay can draw the very same streams on
the very same kernels: the batched simulator runtimes, on the CPU, with seeded
randomness, from the first round. Elsewhere (a device runtime, a GPU, secret noise, a
resumed run) the check runs beside it at the run's own size: a recorded run and its
replay on the CPU simulator with seeded randomness, before the run (`verify_at_size`),
and the verdict says so.

A leak confined to the records that stay unchanged is not seen by the replay (they are
half of each client's records, drawn afresh for each seed): a leak of k records of a
client goes unseen with probability 2^-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from p4bench.config import RunConfig
from p4bench.privacy.isolation import ChangedRecords, excluding
from p4bench.privacy.post_processing import PostProcessingResult, simulator_options
from p4bench.privacy.replay import (
    Recording,
    instrument,
    judge_isolation,
    judge_messages,
    run_recorded,
)
from p4bench.privacy.tape import ReleaseTape, ReplayDiverged, using_tape

__all__ = ["RunRecorder", "not_recordable", "verify_at_size"]


def not_recordable(prepared: Any, resumed: bool) -> str | None:
    """Why the prepared run cannot be its own recording (None: it can)."""
    from p4bench.engine.runtime import GroupedRuntime

    config = prepared.config
    if not isinstance(prepared.runtime, GroupedRuntime):
        return f"runtime '{config.runtime}' runs its clients elsewhere"
    if prepared.device.type != "cpu":
        return (
            f"it ran on {prepared.device.type}, whose kernels a replay need not repeat bit for bit"
        )
    if config.noise_source != "seeded":
        return "its randomness is secret, so no replay can draw it again"
    if resumed:
        return "it was resumed from a checkpoint, so its first rounds were not recorded"
    return None


def _scope(config: RunConfig) -> str:
    return f"{config.clients} clients, {config.rounds} rounds, {config.local_steps} local steps"


class RunRecorder:
    """Records a prepared run for its own verification: `recording()` around its
    execution, then `verdict(...)` after it."""

    def __init__(self, prepared: Any) -> None:
        self.config: RunConfig = prepared.config
        self.recording = Recording(ReleaseTape(), ChangedRecords())
        instrument(prepared, self.recording, "none", self.config.seed)
        self.cpu_seconds = 0.0

    @contextmanager
    def recording_run(self) -> Iterator[None]:
        started = time.process_time()
        assert self.recording.changed is not None
        with using_tape(self.recording.tape), excluding(self.recording.changed):
            yield
        self.cpu_seconds += time.process_time() - started

    def verdict(
        self,
        run: Callable[..., Any],
        pm: Any,
        *,
        stop_at_step: int | None = None,
        **run_options: Any,
    ) -> PostProcessingResult:
        """Replay the recorded run once (the changed half of the records replaced, the
        releases forced) and judge it; `stop_at_step`: where the run stopped early."""
        started, cpu = time.perf_counter(), time.process_time()
        result = _judge(
            run, self.config, pm, self.recording, stop_at_step=stop_at_step, **run_options
        )
        result.notes.insert(
            0, f"verified on the run itself ({_scope(self.config)}) and one replay of it"
        )
        result.seconds = time.perf_counter() - started
        result.scope = "run"
        result.cpu_seconds = time.process_time() - cpu
        self.recording.tape.values.close()
        return result


def _judge(
    run: Callable[..., Any], config: RunConfig, pm: Any, recorded: Recording, **run_options: Any
) -> PostProcessingResult:
    """The verdict of the one replay of `recorded` (a run of `config`)."""
    result = PostProcessingResult(config.method, "verified")
    tape = recorded.tape
    result.releases = len(tape.values)
    if tape.unforceable:
        result.status = "not verifiable"
        result.findings.append(
            f"its releases use {', '.join(tape.unforceable)}, whose value a replay cannot force; "
            "declare the state a fused release updates (`Releases.state_before`/`state_after`)"
        )
        return result
    if not len(tape.values) and not tape.delegated:
        result.notes.append(
            "it made no DP release: every message it sends must then read no record"
        )
    replay = Recording(
        ReleaseTape(tape.values, clean=tape.clean_values), ChangedRecords(), recorded.slots
    )
    try:
        run_recorded(run, config, pm, replay, data_change="changed", **run_options)
    except ReplayDiverged as diverged:
        result.status, result.findings = (
            "failed",
            [f"the releases depend on the changed records: {diverged}"],
        )
        return result
    judge_messages(result, recorded, replay)
    judge_isolation(result, recorded, replay)
    return result


def verify_at_size(
    config: RunConfig, run: Callable[..., Any], pm: Any, why: str
) -> PostProcessingResult:
    """The check at `config`'s own size beside a run that cannot be its own recording
    (`why`): a recorded run and one replay on the CPU simulator with seeded randomness."""
    started, cpu = time.perf_counter(), time.process_time()
    checked = config.replace(
        runtime="simulation",
        device="cpu",
        noise_source="seeded",
        time_budget_min=None,
        options=simulator_options(config),
    )
    recorded = Recording(ReleaseTape(), ChangedRecords())
    run_recorded(run, checked, pm, recorded, data_change="none")
    result = _judge(run, checked, pm, recorded)
    result.notes.insert(
        0,
        f"verified at the run's own size ({_scope(config)}) on the CPU simulator with seeded "
        f"randomness, beside the run: {why}",
    )
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu
    result.scope = "size"
    recorded.tape.values.close()
    return result
