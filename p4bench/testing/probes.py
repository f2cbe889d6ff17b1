"""Instruments for one run, installed through `runner.run(on_prepared=...)` without
touching the engine:

- `spy_on(method, recorder)`: swaps the method instance's class for a subclass that
  records every outgoing message, every inbox and the state layout after each call;
- `count_mechanism(recorder)`: a `Job.wrap_mechanism` that counts the noise each
  group's DP mechanism draws and the releases it reports to the ledger;
- `ProbeDefense`: wraps the run's defense (or none) and counts the aggregations that
  reach it, so "has an aggregator" is observed where defenses act.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.engine.threats import Defense
from p4bench.rng import SERVER_ID

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data.federated import ClientTensors
    from p4bench.engine.method import Method, StepContext
    from p4bench.engine.state import State
    from p4bench.privacy.mechanism import DPMechanism
    from p4bench.privacy.noise import NoiseStreams


__all__ = ["ProbeDefense", "Recorder", "count_mechanism", "probe_defense", "spy_on"]


class Recorder:
    """What one instrumented run observed (filled by the probes below)."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.phase = "init"  # the phase of the call in progress: noise draws are attributed to it
        self.layout_errors: list[str] = []
        self.message_errors: list[str] = []
        self.exchanges: Counter[str] = Counter()  # exchange -> messages delivered
        self.server_messages = 0  # delivered messages from or to the server (-1)
        self.self_messages = 0
        self.individual_updates = 0  # `update.*` messages from one client to another node
        self.update_examples: list[tuple[str, int, int]] = []  # (exchange, src, dst), a few
        self.aggregations = 0  # calls that reached the run's defense
        self.aggregated_updates = 0
        # per phase, (M,) counts: noise events (one `normal_parts` call = one release per
        # row), standard normals drawn, and releases the mechanism reported
        self.noise_events: dict[str, np.ndarray] = defaultdict(
            lambda: np.zeros(num_clients, np.int64)
        )
        self.noise_numbers: dict[str, np.ndarray] = defaultdict(
            lambda: np.zeros(num_clients, np.int64)
        )
        self.batched_phases: set[str] = set()  # phases with several releases' noise drawn at once
        self.releases: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(num_clients, np.int64))
        self.release_rates: dict[str, set[float]] = defaultdict(set)
        self.mechanisms = 0  # groups whose DP mechanism was instrumented
        self.uninstrumented: list[str] = []  # mechanisms whose noise could not be observed

    # -- state layout -----------------------------------------------------------------
    def check_layout(self, where: str, state: Any, rows: int) -> None:
        """Every leaf of a state is a tensor with one row per client of the call."""
        if len(self.layout_errors) >= 5:
            return
        for path, leaf in _leaves(state):
            if not isinstance(leaf, torch.Tensor):
                self.layout_errors.append(
                    f"{where}: state['{path}'] is a {type(leaf).__name__}, not a tensor"
                )
            elif leaf.dim() == 0 or leaf.shape[0] != rows:
                shape = tuple(leaf.shape)
                self.layout_errors.append(
                    f"{where}: state['{path}'] has shape {shape}, expected a leading axis of {rows} rows"
                )

    # -- messages -----------------------------------------------------------------------
    def sent(self, exchange: str, messages: Messages, rows: torch.Tensor, server: bool) -> None:
        if not len(messages) or len(self.message_errors) >= 5:
            return
        who = "server_outgoing" if server else "outgoing"
        if not bool(torch.isin(messages.src, rows).all()):
            bad = sorted(set(messages.src[~torch.isin(messages.src, rows)].tolist()))
            self.message_errors.append(
                f"{who}('{exchange}') of rows {rows.tolist()} sends as nodes {bad}"
            )
        valid = (
            (messages.dst >= SERVER_ID) & (messages.dst < self.num_clients)
        ) | messages.is_broadcast()
        if not bool(valid.all()):
            self.message_errors.append(
                f"{who}('{exchange}') addresses unknown nodes {sorted(set(messages.dst[~valid].tolist()))}"
            )

    def received(self, exchange: str, inbox: Messages) -> None:
        if not len(inbox):
            return
        self.exchanges[exchange] += len(inbox)
        key = inbox.dst * (1 << 32) + inbox.src
        if len(key) > 1 and not bool((key[1:] >= key[:-1]).all()):
            self.message_errors.append(
                f"receive('{exchange}') got an inbox not sorted by (dst, src)"
            )
        self.server_messages += int(((inbox.src == SERVER_ID) | (inbox.dst == SERVER_ID)).sum())
        self.self_messages += int((inbox.src == inbox.dst).sum())
        if any(k.startswith(UPDATE_PREFIX) for k in inbox.table):
            single = (inbox.src >= 0) & (inbox.src != inbox.dst)
            self.individual_updates += int(single.sum())
            for i in single.nonzero().squeeze(1)[:3].tolist():
                if len(self.update_examples) < 3:
                    self.update_examples.append((exchange, int(inbox.src[i]), int(inbox.dst[i])))

    # -- DP mechanism -------------------------------------------------------------------
    def drew(self, nodes: list[int], numbers: int, event: bool) -> None:
        ids = np.array([n for n in nodes if 0 <= n < self.num_clients], dtype=np.int64)
        if event:
            np.add.at(self.noise_events[self.phase], ids, 1)
        else:
            self.batched_phases.add(self.phase)
        np.add.at(self.noise_numbers[self.phase], ids, int(numbers))

    def released(self, release: Any) -> None:
        phase = str(getattr(release, "phase", ""))
        np.add.at(
            self.releases[phase],
            np.array(release.clients, dtype=np.int64),
            int(getattr(release, "steps", 1)),
        )
        self.release_rates[phase].add(float(release.sample_rate))


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    else:
        yield prefix, tree


# -- the method spy ------------------------------------------------------------------------
def spy_on(method: Method, recorder: Recorder) -> None:
    """Make `method` (an instance) report to `recorder`; its behaviour is unchanged."""
    method.__class__ = _spy_class(type(method), recorder)


def _spy_class(cls: type[Method], recorder: Recorder) -> type[Method]:
    """A subclass of `cls` made at run time, with the same names: behaviour inherited,
    calls observed (each hook records around `cls`'s own)."""

    def init_client_state(self: Method, train: ClientTensors, ctx: StepContext) -> State:
        recorder.phase = "init"
        state = cls.init_client_state(self, train, ctx)
        recorder.check_layout("init_client_state", state, len(ctx.rows))
        return state

    def local_update(
        self: Method, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        recorder.phase = ctx.phase
        state, losses = cls.local_update(self, state, train, ctx)
        recorder.check_layout(f"local_update ({ctx.phase})", state, len(ctx.rows))
        if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (len(ctx.rows),):
            shape = (
                tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            )
            recorder.layout_errors.append(
                f"local_update returns losses of shape {shape}, expected ({len(ctx.rows)},)"
            )
        return state, losses

    def outgoing(self: Method, exchange: str, state: State, ctx: StepContext) -> Messages:
        recorder.phase = ctx.phase
        messages = cls.outgoing(self, exchange, state, ctx)
        recorder.sent(exchange, messages, ctx.rows, server=False)
        return messages

    def receive(
        self: Method, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        recorder.phase = ctx.phase
        recorder.received(exchange, inbox)
        state = cls.receive(self, exchange, state, inbox, ctx)
        recorder.check_layout(f"receive('{exchange}')", state, len(ctx.rows))
        return state

    def server_outgoing(self: Method, exchange: str, state: State, ctx: StepContext) -> Messages:
        recorder.phase = ctx.phase
        messages = cls.server_outgoing(self, exchange, state, ctx)
        recorder.sent(exchange, messages, torch.tensor([SERVER_ID]), server=True)
        return messages

    def server_receive(
        self: Method, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        recorder.phase = ctx.phase
        recorder.received(exchange, inbox)
        return cls.server_receive(self, exchange, state, inbox, ctx)

    hooks = (init_client_state, local_update, outgoing, receive, server_outgoing, server_receive)
    namespace = {hook.__name__: hook for hook in hooks}
    spy = type(
        cls.__name__,
        (cls,),
        {**namespace, "__qualname__": cls.__qualname__, "__module__": cls.__module__},
    )
    return cast("type[Method]", spy)  # three-argument type() is typed as returning a plain `type`


# -- the DP mechanism counter -------------------------------------------------------------
class _CountingNoise:
    """A `NoiseStreams` that tells `recorder` how many normals each node draws."""

    def __init__(self, inner: NoiseStreams, recorder: Recorder) -> None:
        self.inner, self.recorder = inner, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self, positions: torch.Tensor) -> _CountingNoise:
        return _CountingNoise(self.inner.take(positions), self.recorder)

    def normal(self, size: int) -> torch.Tensor:
        self.recorder.drew(list(self.inner.node_ids), int(size), event=True)
        return self.inner.normal(size)

    def normal_parts(self, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        self.recorder.drew(list(self.inner.node_ids), sum(math.prod(s) for s in shapes), event=True)
        return self.inner.normal_parts(shapes)

    def fill(
        self, parts: Sequence[torch.Tensor]
    ) -> None:  # several releases' noise at once (fused paths)
        per_row = sum(int(p[0].numel()) for p in parts if len(p))
        self.recorder.drew(list(self.inner.node_ids), per_row, event=False)
        self.inner.fill(parts)


def count_mechanism(recorder: Recorder) -> Callable[[DPMechanism], DPMechanism]:
    """A `Job.wrap_mechanism`: the group's mechanism itself, with its noise streams and
    its ledger report counted (the DP path and the ledger are not replaced)."""

    def wrap(mechanism: Any) -> Any:
        recorder.mechanisms += 1
        if hasattr(mechanism, "noise") and hasattr(mechanism, "report"):
            mechanism.noise = _CountingNoise(mechanism.noise, recorder)
            report = mechanism.report

            def counted(release: Any) -> None:
                recorder.released(release)
                report(release)

            mechanism.report = counted
        else:
            recorder.uninstrumented.append(type(mechanism).__name__)
        return mechanism

    return wrap


# -- the defense probe ---------------------------------------------------------------------
class ProbeDefense(Defense):
    """The run's defense (or a plain weighted mean when there is none), counting the
    aggregations that reach it. Build it with `probe_defense`, which copies the inner
    defense's class flags (`filters`, `uses_identities`)."""

    name = "conformance-probe"
    needs_individual_updates = False

    def __init__(self, config: RunConfig, inner: Defense | None, recorder: Recorder) -> None:
        super().__init__(config)
        self.inner, self.recorder = inner, recorder

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.recorder.aggregations += 1
        self.recorder.aggregated_updates += int(mask.sum())
        # annotated: Defense.aggregate is typed Any (the `screened` decorator)
        result: tuple[torch.Tensor, torch.Tensor] = (
            self.inner.aggregate(updates, weights, mask, **identities)
            if self.inner is not None
            else super().aggregate(updates, weights, mask)
        )
        return result


def probe_defense(config: RunConfig, inner: Defense | None, recorder: Recorder) -> ProbeDefense:
    """A `ProbeDefense` around `inner` whose class flags are the inner defense's."""
    flags = (
        {"filters": bool(inner.filters), "uses_identities": bool(inner.uses_identities)}
        if inner is not None
        else {"filters": False, "uses_identities": False}
    )
    cls = type("ConformanceProbe", (ProbeDefense,), flags)
    probe: ProbeDefense = cls(
        config, inner, recorder
    )  # annotated: a class made by type() is typed `type`
    return probe
