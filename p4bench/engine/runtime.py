"""Runtimes execute a method's phases, rounds and steps over groups of client rows.

The simulator holds all clients in one group, so every step is one batched call. The
reference runtime holds one client per group and computes gradients with plain
autograd. The bytes runtime also holds one client per group and sends every message
through safetensors bytes, as a one-process-per-client deployment does. All three run
the same method code and draw the same per-client random streams.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from p4bench.engine.memory import keep_freed_memory
from p4bench.engine.messages import Messages, decode, encode, frame_sizes
from p4bench.engine.method import Exchange, LocalUpdate, Method, Phase, Step, StepContext
from p4bench.engine.state import State, cat_rows, put_rows, take_rows, vectorize
from p4bench.engine.threats import UPDATE_PREFIX, Aggregator, Attack, Defense
from p4bench.engine.training import accuracy, batched_loss_and_grad, reference_loss_and_grad
from p4bench.models import Model, Params
from p4bench.rng import SERVER_ID, ClientRng, client_rng, node_keys, secret_draws

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import ClientTensors, FederatedData
    from p4bench.privacy.mechanism import DPMechanism, DPSettings, Release

# Independent stream families derived from one run seed.
STREAM_TRAINING, STREAM_ATTACK = 0, 2


@dataclass
class Job:
    """Everything a runtime needs to execute one run."""

    config: "RunConfig"
    method: Method
    model: Model
    data: "FederatedData"
    attack: Attack | None = None
    defense: Defense | None = None
    malicious: torch.Tensor | None = None  # (M,) bool, known to the harness only
    dp: "DPSettings | None" = None
    report_release: Callable[["Release"], None] = lambda release: None
    release_allowed: Callable[[torch.Tensor, float, str], torch.Tensor] = lambda c, rate, phase: torch.ones(len(c), dtype=torch.bool)
    # Replaces each group's DP mechanism by a wrapper around it (the privacy audit's canaries).
    wrap_mechanism: Callable[["DPMechanism"], "DPMechanism"] | None = None


@dataclass
class RoundReport:
    """Metrics of one finished round."""

    phase: str
    round: int
    step: int  # rounds finished so far over all phases
    accuracy: np.ndarray  # (M,) each client's deployed model on its own test split
    train_loss: float  # mean loss over the round's local updates (nan if none)
    seconds: float  # the round's steps (computation and communication), evaluation excluded
    bytes_sent: int  # all clients (and the server), this round, self-messages excluded
    metrics: dict[str, float] = field(default_factory=dict)
    client_bytes_sent: np.ndarray | None = None  # (M,) communication ledger, this round
    client_bytes_received: np.ndarray | None = None
    extra_accuracy: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. {"proxy": (M,)}


@dataclass
class Outcome:
    accuracy: np.ndarray
    extra_accuracy: dict[str, np.ndarray]
    reports: list[RoundReport]
    final_params: Params  # (M, ...) deployed parameters, for cross-runtime checks
    bytes_sent: int
    final_state: State | None = None  # every client's state, rows in client order


@dataclass
class _Group:
    rows: torch.Tensor
    state: State
    train: "ClientTensors"
    test: "ClientTensors"
    rng: ClientRng
    attack_rng: ClientRng
    dp: "DPMechanism | None" = None


class Runtime(ABC):
    """Base class of runtime plugins."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Clients are separate parties (devices): DP randomness must then be secret per client.
    separate_parties: ClassVar[bool] = False

    @abstractmethod
    def execute(self, job: Job, on_round: Callable[[RoundReport], None]) -> Outcome:
        """Run every phase of `job.method`, calling `on_round` after each round."""


class GroupedRuntime(Runtime):
    """Shared driver: subclasses choose how clients are grouped, how gradients are
    computed and how messages travel."""

    batched_gradients: ClassVar[bool] = True

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        """Client ids held by each group (one per process in a deployment)."""
        return [torch.arange(num_clients)]

    def deliver(self, exchange: str, round_index: int, messages: Messages) -> tuple[Messages, torch.Tensor]:
        """Messages as the receivers get them, and each one's size on the wire (bytes of
        its serialised frame; the simulator computes it exactly without serialising)."""
        return messages, frame_sizes(exchange, round_index, messages)

    # -- driver ------------------------------------------------------------------------
    def execute(self, job: Job, on_round: Callable[[RoundReport], None]) -> Outcome:
        keep_freed_memory()  # large per-step temporaries: reuse freed memory instead of faulting it in again
        self.job, method, config = job, job.method, job.config
        self.aggregator = Aggregator(job.defense)
        gradient = batched_loss_and_grad if self.batched_gradients else reference_loss_and_grad
        self._loss_and_grad = partial(gradient, job.model)
        self._malicious = job.malicious if job.malicious is not None else torch.zeros(job.data.num_clients, dtype=torch.bool)
        self.groups = [self._make_group(rows) for rows in self.group_rows(job.data.num_clients)]
        server_rows = torch.tensor([SERVER_ID])
        self.server_rng = client_rng(config.seed, server_rows, STREAM_TRAINING, secret_draws(config.noise_source, self.separate_parties))
        self.server_state = (
            method.init_server_state(self._context(server_rows, self.server_rng, "init", -1))
            if method.capabilities.uses_server
            else {}
        )
        reports: list[RoundReport] = []
        total_bytes = 0
        count = job.data.num_clients
        for phase in method.phases():
            self._round_losses: list[torch.Tensor] = []
            self._sent, self._received = np.zeros(count, np.int64), np.zeros(count, np.int64)
            total_bytes += self._run_steps(phase.setup, phase, -1)
            for round_index in range(phase.rounds):
                started = time.perf_counter()
                self._round_losses = []
                if round_index:
                    self._sent, self._received = np.zeros(count, np.int64), np.zeros(count, np.int64)
                sent = self._run_steps(method.round_steps(phase, round_index), phase, round_index)
                step_seconds = time.perf_counter() - started  # training and communication, not evaluation
                total_bytes += sent
                losses = torch.cat(self._round_losses) if self._round_losses else torch.zeros(0)
                accuracy, extra = self.evaluate()
                reports.append(
                    RoundReport(
                        phase=phase.name,
                        round=round_index,
                        step=len(reports) + 1,
                        accuracy=accuracy,
                        train_loss=float(losses.mean()) if len(losses) else float("nan"),
                        seconds=step_seconds,
                        bytes_sent=sent,
                        client_bytes_sent=self._sent,
                        client_bytes_received=self._received,
                        extra_accuracy=extra,
                    )
                )
                on_round(reports[-1])
        accuracy, extra = self.evaluate()
        order = torch.argsort(torch.cat([g.rows for g in self.groups]))
        final_state = take_rows(cat_rows([g.state for g in self.groups]), order)
        return Outcome(accuracy, extra, reports, self.deployed_params(), total_bytes, final_state)

    def _make_group(self, rows: torch.Tensor) -> _Group:
        data, config = self.job.data, self.job.config
        train, test = data.train.rows(rows), data.test.rows(rows)
        attack = self.job.attack
        if attack is not None:
            bad = self._malicious[rows]
            if bool(bad.any()):
                poisoned = torch.where(bad.unsqueeze(1), attack.poison_labels(train.y), train.y)
                train = replace(train, y=poisoned)
        # Each client's private draws (batches, sampled peers, DP noise): secret where the
        # run says so, else reproducible from the seed. The attack stream is the harness's.
        secret = secret_draws(config.noise_source, self.separate_parties)
        rng = client_rng(config.seed, rows, STREAM_TRAINING, secret)
        group = _Group(rows, {}, train, test, rng, ClientRng(node_keys(config.seed, rows, STREAM_ATTACK)))
        if self.job.dp is not None:
            from p4bench.privacy.mechanism import DPMechanism, NoiseStreams  # the privacy harness builds on the engine

            noise = NoiseStreams(config.seed, rows.tolist(), secure=secret)
            group.dp = DPMechanism(self.job.dp, noise, self.job.report_release, self.job.release_allowed)
            if self.job.wrap_mechanism is not None:
                group.dp = self.job.wrap_mechanism(group.dp)
        group.state = self.job.method.init_client_state(train, self._context(rows, rng, "init", -1, group.dp))
        return group

    def _context(
        self, rows: torch.Tensor, rng: ClientRng, phase: str, round_index: int, dp: "DPMechanism | None" = None
    ) -> StepContext:
        job = self.job
        return StepContext(
            config=job.config,
            model=job.model,
            phase=phase,
            round=round_index,
            rows=rows,
            rng=rng,
            loss_and_grad=self._loss_and_grad,
            aggregator=self.aggregator,
            num_clients=job.data.num_clients,
            dp=dp,
        )

    def _run_steps(self, steps: tuple[Step, ...] | list[Step], phase: Phase, round_index: int) -> int:
        sent = 0
        for step in steps:
            if isinstance(step, LocalUpdate):
                for group in self.groups:
                    self._local_update(group, phase, round_index)
            elif isinstance(step, Exchange):
                sent += self._exchange(step.name, phase, round_index)
            else:
                raise TypeError(f"unknown step {step!r}")
        return sent

    def _local_update(self, group: _Group, phase: Phase, round_index: int) -> None:
        method = self.job.method
        ctx = self._context(group.rows, group.rng, phase.name, round_index, group.dp)
        active = method.participants(group.state, ctx).nonzero().squeeze(1)
        if len(active) == 0:
            return
        if len(active) == len(group.rows):
            group.state, losses = method.local_update(group.state, group.train, ctx)
        else:
            sub_rng = group.rng.take(active)
            sub_dp = group.dp.take(active) if group.dp is not None else None
            sub_ctx = self._context(group.rows[active], sub_rng, phase.name, round_index, sub_dp)
            new_state, losses = method.local_update(take_rows(group.state, active), group.train.rows(active), sub_ctx)
            group.state = put_rows(group.state, active, new_state)
            group.rng.put(active, sub_rng)
        self._round_losses.append(losses.detach().double())

    def _group_outgoing(self, exchange: str, phase: Phase, round_index: int) -> list[Messages]:
        """Each group's messages of `exchange`, after the run's attack (also used by the
        device runtime's one-client nodes)."""
        method, attack = self.job.method, self.job.attack
        outgoing = [
            method.outgoing(exchange, group.state, self._context(group.rows, group.rng, phase.name, round_index, group.dp))
            for group in self.groups
        ]
        if attack is not None and attack.acts_in(phase.name):
            # omniscient attacks see every honest message this process holds (all of them in
            # the simulator and the in-process runtimes; none for a lone node on a device)
            knowledge = self._knowledge(outgoing) if attack.omniscient else [{} for _ in outgoing]
            outgoing = [
                self._tamper(exchange, group, messages, method.update_reference(exchange, group.state), **known)
                if len(messages) else messages
                for group, messages, known in zip(self.groups, outgoing, knowledge)
            ]
        return outgoing

    def _exchange(self, exchange: str, phase: Phase, round_index: int) -> int:
        method = self.job.method
        outgoing = self._group_outgoing(exchange, phase, round_index)
        if method.capabilities.uses_server:
            server_ctx = self._context(torch.tensor([SERVER_ID]), self.server_rng, phase.name, round_index)
            outgoing.append(method.server_outgoing(exchange, self.server_state, server_ctx))
        delivered, sizes = self.deliver(exchange, round_index, Messages.concat(outgoing))
        wire = delivered.src != delivered.dst  # a node does not send to itself over the network
        np.add.at(self._sent, delivered.src[wire & (delivered.src >= 0)].numpy(), sizes[wire & (delivered.src >= 0)].numpy())
        np.add.at(self._received, delivered.dst[wire & (delivered.dst >= 0)].numpy(), sizes[wire & (delivered.dst >= 0)].numpy())
        sent = int(sizes[wire].sum())
        delivered = delivered.sorted()
        for group in self.groups:
            inbox = delivered.select(torch.isin(delivered.dst, group.rows))
            ctx = self._context(group.rows, group.rng, phase.name, round_index, group.dp)
            group.state = method.receive(exchange, group.state, inbox, ctx)
        if method.capabilities.uses_server:
            inbox = delivered.select(delivered.dst == SERVER_ID)
            server_ctx = self._context(torch.tensor([SERVER_ID]), self.server_rng, phase.name, round_index)
            self.server_state = method.server_receive(exchange, self.server_state, inbox, server_ctx)
        return sent

    def _is_malicious(self, messages: Messages) -> torch.Tensor:
        return (messages.src >= 0) & self._malicious[messages.src.clamp_min(0)]

    def _benign(self, outgoing: list[Messages]) -> Messages:
        """The benign clients' update messages among `outgoing` (for omniscient attacks)."""
        return Messages.concat([m.select(~self._is_malicious(m)) for m in outgoing if _carries_updates(m)])

    def _knowledge(self, outgoing: list[Messages]) -> list[dict[str, Messages]]:
        """Per group, what omniscient attackers know besides their own messages: `observed`,
        the benign update messages of the exchange, and `colluding`, the honest messages
        of the malicious clients held by other groups."""
        benign = self._benign(outgoing)
        attackers = [m.select(self._is_malicious(m)) if _carries_updates(m) else Messages.empty() for m in outgoing]
        return [
            {"observed": benign, "colluding": Messages.concat([a for j, a in enumerate(attackers) if j != i])}
            for i in range(len(outgoing))
        ]

    def _tamper(
        self, exchange: str, group: _Group, messages: Messages, reference: Params | None,
        observed: Messages | None = None, colluding: Messages | None = None,
    ) -> Messages:
        bad = self._is_malicious(messages)
        if not bool(bad.any()) or not any(k.startswith(UPDATE_PREFIX) for k in messages.payload):
            return messages  # attacks act on model updates only
        index = bad.nonzero().squeeze(1)
        position = torch.searchsorted(group.rows, messages.src[index])
        rng = group.attack_rng.take(position)
        base = vectorize(reference)[position] if reference is not None else None
        known = {} if observed is None else {"observed": observed, "colluding": colluding if colluding is not None else Messages.empty()}
        tampered = self.job.attack.tamper(exchange, messages.select(index), rng, base, **known)
        group.attack_rng.put(position, rng)
        payload = {k: v.clone() for k, v in messages.payload.items()}
        for key, value in tampered.payload.items():
            payload[key][index] = value.to(payload[key].dtype)
        return Messages(messages.src, messages.dst, payload)

    def evaluate(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Each client's deployed model (and the method's extra models) on its own test split."""
        model, method = self.job.model, self.job.method
        order = torch.argsort(torch.cat([g.rows for g in self.groups]))

        def on_every_client(params_of) -> np.ndarray:
            parts = [accuracy(model, params_of(g.state), g.test.x, g.test.y, g.test.n) for g in self.groups]
            return torch.cat(parts)[order].numpy()

        names = method.extra_models(self.groups[0].state).keys()
        extra = {name: on_every_client(lambda s, n=name: method.extra_models(s)[n]) for name in names}
        return on_every_client(method.deployed_params), extra

    def deployed_params(self) -> Params:
        order = torch.argsort(torch.cat([g.rows for g in self.groups]))
        stacked = cat_rows([self.job.method.deployed_params(g.state) for g in self.groups])
        return {k: v[order] for k, v in stacked.items()}


def _carries_updates(messages: Messages) -> bool:
    return len(messages) > 0 and any(k.startswith(UPDATE_PREFIX) for k in messages.payload)


class SimulationRuntime(GroupedRuntime):
    """All clients in one batch: stacked parameters, vmapped per-client math."""

    name = "simulation"
    description = "batched simulator: all clients of a round in one vectorised step"


class ReferenceRuntime(GroupedRuntime):
    """One client at a time with plain autograd: slow, obvious, used to check the simulator."""

    name = "reference"
    description = "per-client loop with plain autograd (for tests and benchmarks)"
    batched_gradients = False

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        return [torch.tensor([i]) for i in range(num_clients)]


class BytesRuntime(GroupedRuntime):
    """One client per node; every message is encoded to bytes and decoded by its receiver."""

    name = "bytes"
    description = "one node per client, messages serialised to bytes (safetensors) in memory"

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        return [torch.tensor([i]) for i in range(num_clients)]

    def deliver(self, exchange: str, round_index: int, messages: Messages) -> tuple[Messages, torch.Tensor]:
        wire = [encode(exchange, round_index, m) for m in messages.split()]
        received = []
        for frame in wire:
            got_exchange, got_round, message = decode(frame)
            if (got_exchange, got_round) != (exchange, round_index):
                raise RuntimeError(f"message for {got_exchange}/{got_round} delivered during {exchange}/{round_index}")
            received.append(message)
        return Messages.concat(received), torch.tensor([len(frame) for frame in wire], dtype=torch.int64)
