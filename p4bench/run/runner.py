"""One run, end to end: resolve plugins, build data, execute, observe, summarise."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import pluggy
import torch

from p4bench.config import RunConfig
from p4bench.data import FederatedData
from p4bench.data.pipeline import build_run_data
from p4bench.engine import Attack, Defense, Job, Method, RoundReport
from p4bench.engine.chunking import dp_step_bytes, plan_work
from p4bench.engine.devices import (
    MemoryPlan,
    describe_device,
    device_scope,
    plan_memory,
    resolve_device,
)
from p4bench.engine.receive_gate import rejection_counts
from p4bench.errors import IncompatibleError, UsageError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.moved import forward_moved
from p4bench.options import validate_run_options
from p4bench.privacy.certification import certify
from p4bench.privacy.ledger import PrivacyLedger
from p4bench.privacy.network_record import NetworkRecorder
from p4bench.privacy.plan_check import plan_reasons
from p4bench.privacy.replay import replaying
from p4bench.records import RunInfo, RunResult  # re-exported: they were defined here
from p4bench.rng import SEED_MALICIOUS, harness_rng
from p4bench.run import interrupts
from p4bench.run.checkpoint import Checkpoint
from p4bench.run.privacy import setup_privacy
from p4bench.run.resolution import (  # re-exported: they were defined here
    plugin_provenance,
    resolve_run_config,
)
from p4bench.run.session import RunSession, mark_interrupted
from p4bench.run.summary import budget_fields, summarize, summed_metrics, within_budget
from p4bench.run.threads import on_chosen_threads
from p4bench.run.unseen import fine_tune_unseen
from p4bench.run.verify import RunVerification

# the summary's helpers were defined here before 0.2
__getattr__ = forward_moved(
    __name__,
    dict.fromkeys(("DetectionScore", "budget_fields", "reported_mean"), "p4bench.run.summary"),
)


@dataclass
class PreparedRun:
    """A run whose plugins are resolved and checked and whose data is built."""

    config: RunConfig
    job: Job
    runtime: Any
    info: RunInfo
    ledger: PrivacyLedger | None = None
    device: torch.device = torch.device("cpu")
    memory: MemoryPlan | None = None
    stop_at_step: int | None = None  # a verification replay stops where the run it replays stopped
    unseen: FederatedData | None = None  # `--unseen-fraction`: the clients that join after training


# Alters a run's client data (and public data) before the model and method are built
# from its feature shape: the method-level audit appends its canary records there.
DataTransform = Callable[[FederatedData, Any], tuple[FederatedData, Any]]


def prepare(
    config: RunConfig, registry: Registry, data_transform: DataTransform | None = None
) -> PreparedRun:
    """Resolve every plugin name and check compatibility before any data or training.

    `data_transform(data, public)` returns the client data and public data the run
    trains on (the privacy claim's N, for the default delta, is the dataset's own)."""
    requested_hash = config.config_hash()
    config = resolve_run_config(config, registry)
    plugin_options = validate_run_options(
        config, registry
    )  # unknown keys and bad values: before any data
    method_cls: type[Method] = registry.get("method", config.method)
    dataset_cls = registry.get("dataset", config.dataset)
    partitioner_cls = registry.get("partitioner", config.partitioner)
    model_cls = registry.get("model", config.model)
    runtime_cls = registry.get("runtime", config.runtime)
    attack_cls: type[Attack] | None = (
        registry.get("attack", config.attack) if config.attack else None
    )
    defense_name = config.defense if config.defense is not None else method_cls.default_defense
    defense_cls: type[Defense] | None = (
        registry.get("defense", defense_name) if defense_name not in (None, "none") else None
    )
    for kind, cls in (("defense", defense_cls), ("attack", attack_cls)):
        if cls is None:
            continue
        reason = cls.incompatibility(method_cls.capabilities)
        if reason:
            raise IncompatibleError(
                f"{kind} '{cls.name}' cannot be used with method '{config.method}': {reason}"
            )

    device = resolve_device(config.device)
    if device.type != "cpu" and getattr(runtime_cls, "separate_parties", False):
        raise UsageError(
            f"runtime '{config.runtime}' trains on its peers' own processors; --device {config.device} "
            "applies to the simulation runtimes (simulation, reference, bytes)"
        )
    if config.unseen_fraction > 0 and getattr(runtime_cls, "separate_parties", False):
        raise UsageError(
            f"--unseen-fraction applies to the simulation runtimes, not '{config.runtime}'"
        )
    built = build_run_data(
        config,
        dataset_cls,
        partitioner_cls,
        needs_public_data=method_cls.needs_public_data,
        needs_public_labels=method_cls.needs_public_labels,
        feature_device=str(device) if device.type == "cuda" else "cpu",
    )
    data, public, records, partitioner = built.data, built.public, built.records, built.partitioner
    if data_transform is not None:
        data, public = data_transform(data, public)
    whole = config  # the run's; with unseen clients (p4bench.run.unseen) the others train
    if built.unseen is not None:
        config = config.replace(clients=data.num_clients)

    malicious = np.zeros(config.clients, dtype=bool)
    if attack_cls is not None:
        chooser = harness_rng(config.seed, SEED_MALICIOUS)
        malicious[
            chooser.permutation(config.clients)[
                : int(round(config.malicious_fraction * config.clients))
            ]
        ] = True

    host_data = data
    with device_scope(device):  # parameters, method state and data live on the run's device
        model = model_cls(data.feature_shape, data.num_classes)
        method = method_cls(config, model, config.clients)
        method.public_data = public
        num_parameters = model.num_parameters(method.initial_params())
        memory = plan_memory(device, data.nbytes(), state_bytes(num_parameters, config.clients))
        widest = (
            max(1, math.ceil(float(data.train.n.max()) * config.data_rate)) if config.private else 0
        )
        resident = 0 if memory.stream_data else data.nbytes()
        budget = plan_work(
            device,
            resident + memory.state_bytes + method.working_bytes(config.clients),
            dp_step_bytes(model, num_parameters, widest, data.num_classes) if widest else 0,
            int(config.memory_budget_gb * (1 << 30))
            if config.memory_budget_gb is not None
            else None,
        )
        data = data.to(device, stream=memory.stream_data)
        reasons = method.uncertified_steps() + (
            defense_cls.uncertified_steps() if defense_cls is not None else []
        )
        accountant_cls = registry.get("accountant", config.accountant) if config.private else None
        certification = certify(
            config,
            reasons,
            bool(getattr(runtime_cls, "separate_parties", False)),
            accountant_cls,
            method_cls.capabilities,
        )
        malicious_mask = torch.from_numpy(malicious).to(device)
        job = Job(
            config=config,
            method=method,
            model=model,
            data=data,
            attack=attack_cls(config, data.num_classes) if attack_cls else None,
            defense=defense_cls(config) if defense_cls else None,
            malicious=malicious_mask,
            public_records=records,
            public_partition=data.train.n,
            memory_budget=budget,
        )
        if job.defense is not None and job.defense.needs_oracle:
            job.defense.reveal_malicious(malicious_mask)  # the ideal defense: a harness oracle
        ledger = setup_privacy(config, registry, method, job, records) if config.private else None
    info = RunInfo(
        run_id=uuid.uuid4().hex[:12],
        config=whole,
        evaluation=host_data.evaluation.numpy(),
        malicious=malicious,
        phases=method.phases(),
        defense=defense_cls.name if defense_cls else None,
        data=data,
        num_parameters=num_parameters,
        started_at=time.time(),
        certification=certification,
        config_hash=requested_hash,
        plugins=plugin_provenance(config, registry, defense_name, built.source),
        plugin_options=plugin_options,
        public_data=public.description if public is not None else None,
        partition_report=partitioner.report,
    )
    return PreparedRun(whole, job, runtime_cls(), info, ledger, device, memory, unseen=built.unseen)


# Per client: parameters, gradients, and method state (momentum, proxies, control
# variates, received models) - a conservative multiple of one model's size in fp32.
STATE_COPIES = 8


def state_bytes(num_parameters: int, clients: int) -> int:
    """Bytes of device memory the clients' state needs (for `plan_memory`)."""
    return int(num_parameters) * int(clients) * 4 * STATE_COPIES


@on_chosen_threads
def run(
    config: RunConfig,
    observers: Sequence[object] = (),
    plugin_manager: pluggy.PluginManager | None = None,
    track: bool = True,
    on_prepared: Callable[[PreparedRun], None] | None = None,
    resume: Checkpoint | None = None,
    verify: bool = True,
    data_transform: DataTransform | None = None,
    stop_at_step: int | None = None,
) -> RunResult:
    """Execute one run. Observers are plugin objects implementing observation hooks;
    with `track` the MLflow tracker (which also keeps a local copy) is one of them.
    `on_prepared` may adjust the prepared run before training (the privacy audit
    wraps the DP mechanism there); `data_transform` alters the data before the model is
    built (`prepare`; the method-level audit adds its canary records). With `verify` a
    private run is verified by behaviour as `--verify` says (`p4bench.run.verify`: by
    default the run itself is recorded and replayed once after its last round; verdicts
    are cached per configuration and code); without, it is not certified.
    `stop_at_step` stops the run after that many rounds (a replay of a run the time
    budget stopped).

    A tracked run is checkpointed into its local folder after its rounds
    (`p4bench.run.checkpoint`); `resume` continues such a run (same config, same folder, same
    MLflow run). A stop request (the first Ctrl-C under `p4bench.run.interrupts`, or
    `request_stop()`) ends the run after the current round with a checkpoint: the MLflow
    run is marked KILLED and `RunInterrupted` raised. Any other KeyboardInterrupt also
    marks the MLflow run KILLED before it propagates.

    The run computes on `config.threads` torch threads, or on the cores it may use
    (`p4bench.run.threads.default_threads`); its config records the number.
    """
    from p4bench.tracking.tracker import Tracker

    if track or any(isinstance(o, Tracker) for o in observers):
        _preflight(config)
    torch.manual_seed(config.seed)  # nothing should use global RNG; this pins stray uses
    pm = plugin_manager or create_plugin_manager()
    registry = Registry(pm)
    if resume is not None:
        check_resumable(config, registry)
        resume.state()  # read now: the tracker continues from the snapshot's own round
    prepared = prepare(config, registry, data_transform)
    prepared.stop_at_step = stop_at_step
    verification = RunVerification(
        prepared, registry, pm, run, enabled=verify, resumed=resume is not None
    )
    if on_prepared is not None:
        on_prepared(prepared)
    network = NetworkRecorder(prepared, resume is not None) if not replaying() else None
    info = prepared.info
    if resume is not None:
        info.run_id = str(resume.meta["run_id"])
    prepared.job.report_release = lambda release: pm.hook.privacy_release(run=info, release=release)
    attached: list[object] = ([prepared.ledger] if prepared.ledger else []) + list(observers)
    if track:
        attached.insert(0, Tracker(prepared.config, resume=resume))
    tracker = next((o for o in attached if isinstance(o, Tracker)), None)
    for observer in attached:
        pm.register(observer)
    try:
        started = time.perf_counter()
        pm.hook.run_started(run=info)
        session = RunSession(prepared, config, resume, tracker)
        if interrupts.stop_requested():  # asked to stop during start-up (a sweep's Ctrl-C)
            raise session.interrupted(attached)

        def on_round(report: RoundReport) -> None:
            session.add_round_metrics(report)
            pm.hook.round_finished(run=info, report=report)
            session.checkpoint(force=interrupts.stop_requested())

        with (
            interrupts.training() if session.runtime is not None else nullcontext(),
            device_scope(prepared.device),
            verification.recording(),
        ):
            outcome = prepared.runtime.execute(
                prepared.job, on_round
            )  # (without interrupts Ctrl-C stops at once)
        if session.stopped_by_request and not session.complete:
            raise session.interrupted(attached)
        trained = time.perf_counter()  # the run's wall time leaves its verification replay out
        verification.finish(outcome, attached, data_transform=data_transform, prepare=on_prepared)
        if (
            session.runtime is not None and session.budget is not None
        ):  # devices: the launcher's budget set it
            outcome.budget_overran_at = session.budget.overran_at
        outcome = within_budget(outcome)
        unseen = fine_tune_unseen(prepared, outcome)  # --unseen-fraction: they join now
        wall = trained - started + session.elapsed_before
        method = prepared.job.method
        totals = summed_metrics(outcome.reports)
        if info.certification is not None and prepared.ledger is not None:
            if info.certification.private:  # the declaration against the ledger
                phases = budget_fields(info, outcome)["phases"]
                extra = plan_reasons(prepared.ledger, method.privacy_plan(), phases)
                info.certification = info.certification.with_reasons(extra)
        summary = summarize(
            info,
            outcome,
            wall,
            method_figures=method.derived_metrics(totals)  # over the whole run
            | {k: v for k, v in totals.items() if k.startswith("gate.")},  # a client gate's
            rejections=rejection_counts(totals),  # the receive gate's (and methods'), by reason
            privacy=prepared.ledger.summary(info.reported) if prepared.ledger else None,
            privacy_context=method.privacy_context()  # who observes the releases
            | (network.summary(prepared.ledger) if network is not None else {}),
            verification=verification.summary if info.certification is not None else {},
            compute_device=describe_device(prepared.device),
            memory=prepared.memory.summary()
            if prepared.memory is not None and prepared.device.type != "cpu"
            else {},
            resumed_from_step=int(resume.meta.get("step", 0)) if resume is not None else None,
            unseen=unseen.summary() if unseen is not None else None,
            threads=torch.get_num_threads(),  # what training used (`run` set it)
        )
        writers = [network.write_artifacts] if network is not None else []
        result = RunResult(info, outcome, wall, summary, method, writers)
        pm.hook.run_finished(run=info, result=result)
        result.summary = dataclasses.replace(result.summary, tracking=dict(info.tracking))
        session.finished()
        return result
    except interrupts.RunInterrupted:
        if not interrupts.installed():  # else the command that installed the handler owns the flag
            interrupts.clear_stop()  # honoured: a later run in this process starts afresh
        raise
    except (
        KeyboardInterrupt
    ):  # a second Ctrl-C, or one outside the rounds: stop now, but say so in MLflow
        mark_interrupted(attached, info)
        raise
    finally:
        for observer in attached:
            pm.unregister(observer)


def check_resumable(config: RunConfig, registry: Registry) -> None:
    """Refuse (UsageError) to resume a run whose runtime cannot restore a checkpoint."""
    from p4bench.engine.runtime import GroupedRuntime

    runtime_cls = registry.get("runtime", config.runtime)
    if not issubclass(runtime_cls, GroupedRuntime):
        raise UsageError(
            f"runtime '{config.runtime}' cannot resume a run from a checkpoint; start the run again"
        )


def _preflight(config: RunConfig) -> None:
    """Unwritable results folders and tracking stores fail before any training
    (`p4bench.run.preflight`, where installed)."""
    import importlib

    try:
        check = importlib.import_module("p4bench.run.preflight").check_run_paths
    except (ImportError, AttributeError):
        return
    check(config)
