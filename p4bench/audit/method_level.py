"""`run_method_audit`: the method-level audit, canary records through the whole method.

The mechanism-level audit (`p4bench.audit.core`) inserts gradient canaries after
clipping inside `DPMechanism.release`: its bound depends on (sigma, q, steps) alone and
cannot see a method that leaks outside the mechanism. This audit puts canary *records*
into the clients' data (`p4bench.audit.records`), so they go through everything the
method does with a record (its sampling, clipping, teachers, personalisation), and
reads them from what the method lets out:

- observer ``messages`` (default): every message a client sends to others, as a
  curious neighbour (or the server) receives it (`p4bench.audit.observer`);
- observer ``final``: the clients' final deployed models (`Outcome.final_params`).
  A method's claim may not cover them (ProxyFL's private models are never released).

Canaries of `runs` trainings (seeds seed..seed+runs-1, fresh canaries and bits each
time) are pooled and bounded as the mechanism-level audit does (`bound`: by default the
one-run bound, `p4bench.audit.one_run`, which needs no independence between the
canaries of a run; "multi-run", `empirical_epsilon`, treats them as independent trials:
every canary has its own marker column, so only the shared bias couples them).

How many canaries fit: each one widens every record by a marker column and adds up to
1 + 4 probe records to its client's data. The default 50 per client (1,000 canaries at
20 clients) already makes probes and canaries outnumber digits' real training records;
the one-run ceiling of 1,000 canaries is about 5.5, and a claim of 8 needs about 12,000
(`--runs 12`); the mechanism level has 13,000 in one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pluggy
import torch

from p4bench.audit.core import check_audit_inputs, finish_audit
from p4bench.audit.observer import MessageScores, canary_values
from p4bench.audit.one_run import audit_bound
from p4bench.audit.records import RecordCanaries
from p4bench.audit.result import AuditResult
from p4bench.config import RunConfig
from p4bench.engine.method import Method
from p4bench.engine.network import ObservedNetwork
from p4bench.errors import IncompatibleError, UsageError

if TYPE_CHECKING:
    from p4bench.data.federated import FederatedData
    from p4bench.data.public import PublicData
    from p4bench.privacy.mechanism import DPMechanism
    from p4bench.run.runner import PreparedRun

__all__ = ["DEFAULT_RECORD_CANARIES", "OBSERVERS", "method_scope", "run_method_audit"]

DEFAULT_RECORD_CANARIES = (
    50  # per client: D = clients x m marker columns, each record that much wider
)
OBSERVERS = {"messages": "neighbour messages", "final": "final models"}
CANARY_KIND = "input records with probe twins"
REPLAYS = "post-processing and record-isolation replays"


def method_scope(observer: str) -> str:
    """What the method-level audit checks, said on its line."""
    return f"method-level: observer {OBSERVERS[observer]}, canaries: {CANARY_KIND}; {REPLAYS}"


def _check_inputs(
    config: RunConfig,
    runs: int,
    canaries_per_client: int | None,
    confidence: float,
    observer: str,
    bound: str,
) -> None:
    check_audit_inputs(runs, canaries_per_client, confidence, bound)
    if observer not in OBSERVERS:
        raise UsageError(f"--observer must be one of {', '.join(OBSERVERS)}, got '{observer}'")
    if not config.private:
        raise UsageError("the audit needs a private run: give --epsilon or --noise-multiplier")


def run_method_audit(
    config: RunConfig,
    *,
    runs: int = 1,
    canaries_per_client: int | None = None,
    confidence: float = 0.95,
    observer: str = "messages",
    bound: str = "one-run",
    wrap_mechanism: Callable[[DPMechanism], DPMechanism] | None = None,
    observers: Sequence[object] = (),
    plugin_manager: pluggy.PluginManager | None = None,
    track: bool = True,
    plot: str | Path | None = None,
    on_run: Callable[[int, dict[str, Any]], None] | None = None,
) -> AuditResult:
    """Audit `config`'s method with canary records: `runs` trainings, then the bound
    (`bound`: one-run, steinke or multi-run, `p4bench.audit.one_run.audit_bound`).

    `wrap_mechanism` replaces the run's DP mechanism (tests and `bench/audit_method.py`
    plant faults there: clipping removed, sampling above the claimed rate). Tracking
    and `plot` as `run_audit`.
    """
    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.models import LinearSoftmax
    from p4bench.run.resolution import resolve_run_config
    from p4bench.run.runner import run

    started, cpu = time.perf_counter(), time.process_time()
    plugin_manager = plugin_manager or create_plugin_manager()
    registry = Registry(plugin_manager)
    config = resolve_run_config(config, registry)  # DP methods: their default epsilon
    _check_inputs(config, runs, canaries_per_client, confidence, observer, bound)
    model_cls = registry.get("model", config.model)
    if not issubclass(model_cls, LinearSoftmax):
        raise IncompatibleError(
            f"the method-level audit reads canaries from a linear model's marker columns; "
            f"model '{config.model}' is not one (use --model linear on flat features)"
        )
    method_cls: type[Method] = registry.get("method", config.method)
    neighbouring = config.neighbouring or method_cls.default_neighbouring
    per_client = canaries_per_client or DEFAULT_RECORD_CANARIES
    scores, included, summaries, claims, deltas, kinds = [], [], [], [], [], set()
    for index in range(runs):
        run_config = config.replace(seed=config.seed + index)
        state: dict[str, Any] = {}

        def transform(
            data: FederatedData,
            public: PublicData | None,
            state: dict[str, Any] = state,
            seed: int = run_config.seed,
        ) -> tuple[FederatedData, PublicData | None]:
            canaries = RecordCanaries(
                data.num_clients, per_client, data.num_classes, seed, config.clip, neighbouring
            )
            state["canaries"] = canaries
            return canaries.transform(data, public)

        def on_prepared(prepared: PreparedRun, state: dict[str, Any] = state) -> None:
            canaries: RecordCanaries = state["canaries"]
            params = prepared.job.method.initial_params()
            if sorted(params) != ["bias", "weight"]:
                raise IncompatibleError(
                    f"the method-level audit expects a linear model's bias and weight, the method "
                    f"trains {sorted(params)}"
                )
            own, reference = canaries.parameter_index(prepared.job.data.num_classes)
            state.update(own=own, reference=reference, ledger=prepared.ledger)
            if observer == "messages":
                scorer = MessageScores(own, reference, params)
                state["scorer"] = scorer
                network = getattr(prepared.runtime, "network", None)
                if network is None:
                    raise IncompatibleError(
                        f"runtime '{prepared.config.runtime}' has no network the audit can observe"
                    )
                prepared.runtime.network = lambda: ObservedNetwork(
                    network(), lambda *sent: scorer.add(sent[-1])
                )
            if wrap_mechanism is not None:
                existing = prepared.job.wrap_mechanism
                prepared.job.wrap_mechanism = (
                    wrap_mechanism
                    if existing is None
                    else (lambda mechanism: existing(wrap_mechanism(mechanism)))
                )

        result = run(
            run_config,
            observers=observers,
            plugin_manager=plugin_manager,
            track=track,
            on_prepared=on_prepared,
            data_transform=transform,
        )
        canaries, ledger = state["canaries"], state["ledger"]
        if observer == "messages":
            scorer = state["scorer"]
            if not bool((scorer.messages > 0).any()):
                raise IncompatibleError(
                    f"method '{config.method}': no client sent a model, update or gradient the "
                    f"audit could read; try --observer final"
                )
            trial_scores = scorer.scores.numpy()
            kinds |= scorer.kinds
        else:
            final = _vectors(result.outcome.final_params)
            trial_scores = canary_values(
                final, torch.from_numpy(state["own"]), torch.from_numpy(state["reference"])
            ).numpy()
        claimed = float(result.summary["epsilon"])
        # the clients whose own epsilon is within the claim (the reported ones at least)
        chosen = ledger.epsilons() <= claimed * (1 + 1e-9) + 1e-12
        scores.append(trial_scores[chosen].reshape(-1))
        included.append(canaries.included[chosen].reshape(-1))
        summaries.append(result.summary.as_dict())
        claims.append(claimed)
        deltas.append(float(result.summary["delta"]))
        if on_run is not None:
            on_run(index, result.summary.as_dict())

    # what the trials may be too few to show: anything outside the releases, or inside one
    # beyond the record's own term (run on a small federation, without a planted fault)
    from p4bench.privacy.post_processing import run_check

    behaviour = run_check(config, run, plugin_manager).as_dict()
    all_scores, all_included = np.concatenate(scores), np.concatenate(included)
    if not np.isfinite(all_scores).all():
        raise IncompatibleError(
            f"method '{config.method}': canary scores are not finite (the model diverged)"
        )
    figures = audit_bound(
        all_scores,
        all_included,
        delta=max(deltas),
        confidence=confidence,
        bound=bound,
        seed=config.seed,
    )
    flags = [s.get("epsilon_certified") for s in summaries]
    certified = None if any(f is None for f in flags) else all(bool(f) for f in flags)
    last = summaries[-1]
    notes = [f"the observer read {', '.join(sorted(kinds))} from the messages"] if kinds else []
    audit = AuditResult(
        config=config,
        bound=figures,
        claimed_epsilon=max(claims),
        certified=certified,
        accountant=str(last.get("accountant")),
        neighbouring=str(last.get("neighbouring")),
        runs=runs,
        canaries_per_client=per_client,
        scores=all_scores,
        included=all_included,
        summaries=summaries,
        notes=notes,
        level="method",
        observer=observer,
        scope=method_scope(observer),
        behaviour=behaviour,
    )
    return finish_audit(audit, last, track=track, plot=plot, started=started, cpu=cpu)


def _vectors(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """(M, P) every client's deployed model in `vectorize` order."""
    return torch.cat(
        [params[k].detach().cpu().reshape(len(params[k]), -1) for k in sorted(params)], dim=1
    )
