"""The round driver: the one place that executes a method's phases, rounds and steps.

Every runtime runs this code; runtimes differ only in the `Network` they hand it and
in which clients this process holds (all of them in one batched group for the
simulator, one client per group for the reference and bytes runtimes, a single client
or only the server on a device peer). Local updates, outgoing messages, the run's
attack, delivery, defenses (inside `receive`), the DP mechanism of each group, the
communication ledger and evaluation are all driven here, so "the same protocol in
every runtime" holds by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from p4bench.engine.attacking import attacker_knowledge, carries_updates, poison, tamper
from p4bench.engine.chunking import memory_budget
from p4bench.engine.evaluation import gate_received, test_metrics
from p4bench.engine.memory import keep_freed_memory
from p4bench.engine.messages import Messages, broadcast_receipts
from p4bench.engine.method import Exchange, LocalUpdate, Phase, StepContext
from p4bench.engine.network import Network
from p4bench.engine.receive_gate import ReceiveGate, Rejections
from p4bench.engine.schedule import (  # Block ... TimeBudget: defined here before
    Block,
    StopAfter,
    TimeBudget,
    budget_rule,
    schedule,
    stop_reason,
)
from p4bench.engine.state import State, cat_rows, put_rows, take_rows
from p4bench.engine.threats import Aggregator
from p4bench.engine.training import (
    accuracy,
    batched_loss_and_grad,
    reference_loss_and_grad,
    shared_accuracy,
)
from p4bench.models import Params
from p4bench.records import GLOBAL_ACCURACY, Outcome, RoundReport
from p4bench.rng import SERVER_ID, ClientRng, client_rng, node_keys, secret_draws

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.job import Job
    from p4bench.privacy.mechanism import DPMechanism

__all__ = [
    "Block",
    "ClientGroup",
    "RoundDriver",
    "StopAfter",
    "TimeBudget",
    "schedule",
    "STREAM_TRAINING",
    "STREAM_ATTACK",
]

# Independent stream families derived from one run seed.
STREAM_TRAINING, STREAM_ATTACK = 0, 2


@dataclass
class ClientGroup:
    """Clients one batched call handles: their rows, state, data and random streams."""

    rows: torch.Tensor
    state: State
    train: ClientTensors
    test: ClientTensors
    rng: ClientRng
    attack_rng: ClientRng
    dp: DPMechanism | None = None


class RoundDriver:
    """Executes one run's schedule for the clients (and server) this process holds."""

    def __init__(
        self,
        job: Job,
        network: Network,
        group_rows: Sequence[torch.Tensor],
        *,
        holds_server: bool,
        batched_gradients: bool = True,
        separate_parties: bool = False,
    ) -> None:
        self.job, self.network = job, network
        self.method, self.config = job.method, job.config
        self.aggregator = Aggregator(job.defense)
        self.separate_parties = separate_parties
        self.holds_server = holds_server and job.method.capabilities.uses_server
        gradient = batched_loss_and_grad if batched_gradients else reference_loss_and_grad
        self._loss_and_grad = partial(gradient, job.model)
        count = job.data.num_clients
        self._malicious = (
            job.malicious if job.malicious is not None else torch.zeros(count, dtype=torch.bool)
        )
        self.receive_errors = 0
        # broadcasts stay one message where the network delivers them so (in process)
        self._broadcasts = network.carry_broadcasts(count)
        self._gates = job.defense is not None and job.defense.gates_clients
        # what every inbox is held to before `receive` (counts, finite values, ranges);
        # rejections are counted per block and reported in its metrics
        self.rejections = Rejections()
        self.receive_gate = ReceiveGate(job.method, job.public_records, self.rejections)
        # what the method writes to `ctx.metrics` in a block (e.g. FedDF's server distillation
        # steps and seconds): reported with the block's RoundReport.metrics
        self._metrics: dict[str, float] = {}
        self.groups = [self._make_group(rows) for rows in group_rows]
        self._holds_everyone = (
            sum(len(rows) for rows in group_rows) == count
        )  # the method's stop rule needs all
        server_rows = torch.tensor([SERVER_ID])
        secret = secret_draws(
            self.config.noise_source, separate_parties
        )  # a server peer is a party too
        self.server_rng = client_rng(self.config.seed, server_rows, STREAM_TRAINING, secret)
        self.server_state: State = (
            self.method.init_server_state(self._context(server_rows, self.server_rng, "init", -1))
            if self.holds_server
            else {}
        )
        # Progress through the schedule, written back by a checkpoint (p4bench.run.checkpoint) to resume
        self.position = 0  # blocks of `schedule(method)` completed
        self.reports: list[RoundReport] = []  # every round's report so far
        self.total_bytes = 0

    # -- the schedule ------------------------------------------------------------------
    def run(
        self,
        on_round: Callable[[RoundReport], None],
        on_setup: Callable[[RoundReport], None] | None = None,
        stop_after: StopAfter | None = None,
    ) -> Outcome:
        """Every block of the schedule; `on_round` after each round (with evaluation),
        `on_setup` after each phase's setup steps. After each round (and its `on_round`)
        `stop_after(step)` may end the run: the final evaluation is then that of the last
        completed round. By default it is the config's time budget, counted from here;
        a device peer passes the launcher's decision instead (`plugins/p4bench_device/node.py`),
        the runner adds the stop request of a Ctrl-C (`p4bench.run.interrupts`).

        The run starts at block `position` with `reports` so far: both are zero unless a
        checkpoint was restored into this driver (`p4bench.run.checkpoint.restore`)."""
        keep_freed_memory()  # large per-step temporaries: reuse freed memory instead of faulting it in again
        gb = self.config.memory_budget_gb
        budget = (
            self.job.memory_budget
            if self.job.memory_budget is not None
            else (int(gb * (1 << 30)) if gb is not None else None)
        )
        with memory_budget(budget):
            return self._run_schedule(on_round, on_setup, stop_after)

    def _run_schedule(
        self,
        on_round: Callable[[RoundReport], None],
        on_setup: Callable[[RoundReport], None] | None,
        stop_after: StopAfter | None,
    ) -> Outcome:
        if stop_after is None:
            stop_after = budget_rule(self.config.time_budget_min)
        if (
            self.reports
            and self._holds_everyone
            and self.method.finished(self.reports[-1].extra_accuracy)
        ):
            self.position = (
                self.blocks()
            )  # the method's own stopping rule ended the run at the checkpoint
        for index, block in enumerate(schedule(self.method)):
            if index < self.position:
                continue  # done before the checkpoint this driver was restored from
            report = self._run_block(block, len(self.reports) + 1)
            self.total_bytes += report.bytes_sent
            self.position = index + 1
            if block.kind == "round":
                self.reports.append(report)
                on_round(report)
                reason = stop_reason(
                    report.step,
                    report.extra_accuracy,
                    stop_after,
                    self.method,
                    self._holds_everyone,
                )
                if reason == "method":
                    self.position = self.blocks()  # the run is complete: a checkpoint says so
                if reason is not None:
                    break
            elif on_setup is not None:
                on_setup(report)
        accuracy_now, extra = self.evaluate()
        final_state = self._final_state() if self.groups else None
        return Outcome(
            accuracy_now,
            extra,
            list(self.reports),
            self.deployed_params(),
            self.total_bytes,
            final_state,
        )

    def blocks(self) -> int:
        """The number of blocks in the schedule."""
        return sum(1 for _ in schedule(self.method))

    @property
    def complete(self) -> bool:
        """Whether the run is over: every block of the schedule ran, or the method's own
        stopping rule (`Method.finished`) ended it."""
        return self.position >= self.blocks()

    def _run_block(self, block: Block, step: int) -> RoundReport:
        count = self.job.data.num_clients
        self._losses: list[torch.Tensor] = []
        # the communication ledger stays where the messages are; read once, in the report
        self._sent, self._received = (
            torch.zeros(count, dtype=torch.int64),
            torch.zeros(count, dtype=torch.int64),
        )
        self._bytes_sent, self._bytes_received = (
            torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64),
        )
        self._metrics = {}
        self.rejections.clear()
        self.network.begin_round(block.phase.name, block.round)
        started = time.perf_counter()
        for item in block.steps:
            if isinstance(item, LocalUpdate):
                for group in self.groups:
                    with self.network.computing():
                        self._local_update(group, block.phase, block.round)
            elif isinstance(item, Exchange):
                self._exchange(item.name, block.phase, block.round)
            else:
                raise TypeError(f"unknown step {item!r}")
        seconds = time.perf_counter() - started  # training and communication, not evaluation
        self.network.steps_finished(block.phase.name, block.round)
        losses = torch.cat(self._losses) if self._losses else torch.zeros(0, dtype=torch.float64)
        accuracy_now, extra = self.evaluate() if block.kind == "round" else (np.zeros(0), {})
        return RoundReport(
            phase=block.phase.name,
            round=block.round,
            step=step,
            accuracy=accuracy_now,
            train_loss=float(losses.mean()) if len(losses) else float("nan"),
            seconds=seconds,
            bytes_sent=int(self._bytes_sent),
            bytes_received=int(self._bytes_received),
            client_bytes_sent=self._sent.cpu().numpy(),
            client_bytes_received=self._received.cpu().numpy(),
            extra_accuracy=extra,
            losses=losses.cpu().numpy(),
            metrics={**self._metrics, **self.rejections.metrics()},
        )

    # -- groups and contexts -----------------------------------------------------------
    def _make_group(self, rows: torch.Tensor) -> ClientGroup:
        job, config = self.job, self.config
        train, test = job.data.train.rows(rows), job.data.test.rows(rows)
        attack_rng = ClientRng(node_keys(config.seed, rows, STREAM_ATTACK))
        if job.attack is not None:
            bad = self._malicious[rows].nonzero().squeeze(1)
            if len(bad):
                train = replace(train, y=poison(job.attack, train.y, bad, attack_rng))
        # Each client's private draws (batches, sampled peers, DP noise): secret where the
        # run says so, else reproducible from the seed. The attack stream is the harness's.
        secret = secret_draws(config.noise_source, self.separate_parties)
        rng = client_rng(config.seed, rows, STREAM_TRAINING, secret)
        group = ClientGroup(rows, {}, train, test, rng, attack_rng)
        if job.dp_factory is not None:
            group.dp = job.dp_factory(rows, secret)
        group.state = self.method.init_client_state(
            train, self._context(rows, rng, "init", -1, group.dp, train)
        )
        return group

    def _context(
        self,
        rows: torch.Tensor,
        rng: ClientRng,
        phase: str,
        round_index: int,
        dp: DPMechanism | None = None,
        train: ClientTensors | None = None,
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
            metrics=self._metrics,
            train=train,
            rejections=self.rejections,
            dp_settings=job.dp,
        )

    def _group_context(self, group: ClientGroup, phase: str, round_index: int) -> StepContext:
        return self._context(group.rows, group.rng, phase, round_index, group.dp, group.train)

    def _server_context(self, phase: Phase, round_index: int) -> StepContext:
        return self._context(torch.tensor([SERVER_ID]), self.server_rng, phase.name, round_index)

    def _final_state(self) -> State:
        """Every held client's state in client order (no copy when one group holds them in order)."""
        if len(self.groups) == 1 and torch.equal(
            self.groups[0].rows, torch.arange(len(self.groups[0].rows))
        ):
            return self.groups[0].state
        return take_rows(cat_rows([g.state for g in self.groups]), self._order())

    def _order(self) -> torch.Tensor:
        return torch.argsort(torch.cat([g.rows for g in self.groups]))

    # -- steps -------------------------------------------------------------------------
    def _local_update(self, group: ClientGroup, phase: Phase, round_index: int) -> None:
        ctx = self._group_context(group, phase.name, round_index)
        active = self.method.participants(group.state, ctx).nonzero().squeeze(1)
        if len(active) == 0:
            return
        if len(active) == len(group.rows):
            group.state, losses = self.method.local_update(group.state, group.train, ctx)
        else:
            sub_rng = group.rng.take(active)
            sub_dp = group.dp.take(active) if group.dp is not None else None
            sub_ctx = self._context(
                group.rows[active],
                sub_rng,
                phase.name,
                round_index,
                sub_dp,
                group.train.rows(active),
            )
            new_state, losses = self.method.local_update(
                take_rows(group.state, active), group.train.rows(active), sub_ctx
            )
            group.state = put_rows(group.state, active, new_state)
            group.rng.put(active, sub_rng)
        self._losses.append(losses.detach().double())

    def _exchange(self, exchange: str, phase: Phase, round_index: int) -> None:
        method = self.method
        self.network.start_exchange(exchange)
        with self.network.computing():
            parts = self._group_outgoing(exchange, phase, round_index)
            if self.holds_server:
                parts.append(
                    method.server_outgoing(
                        exchange, self.server_state, self._server_context(phase, round_index)
                    )
                )
            outgoing = Messages.concat(parts)
            broadcasts = len(outgoing) > 0 and bool(
                outgoing.is_broadcast().any()
            )  # the exchange's one read for it
            if broadcasts and (
                not self._broadcasts or carries_updates(outgoing)
            ):  # defenses see one update per receiver
                outgoing, broadcasts = outgoing.expand_broadcasts(self.job.data.num_clients), False
        delivery = self.network.exchange(exchange, phase.name, round_index, outgoing)
        self._account(
            outgoing,
            delivery.sent_sizes,
            delivery.inbox,
            delivery.inbox_sizes,
            exchange,
            round_index,
            broadcasts,
        )
        admitted = self.receive_gate.admit(exchange, phase.name, round_index, delivery.inbox)
        inbox = admitted.sorted()  # by (dst, src): the order every runtime delivers in
        foreign = bool((inbox.src != inbox.dst).any()) if len(inbox) else False
        with self.network.computing():
            for group in self.groups:
                mine = inbox.select(torch.isin(inbox.dst, group.rows) | inbox.is_broadcast())
                ctx = self._group_context(group, phase.name, round_index)
                # `_receive` calls the lambda before the loop moves on: binding `group` late is safe.
                state = self._receive(
                    lambda box: method.receive(exchange, group.state, box, ctx),  # noqa: B023
                    mine,
                    foreign,
                    exchange,
                )
                if state is not None:
                    group.state = self._gate(group, state) if self._gates else state
            if self.holds_server:
                mine = inbox.select(inbox.dst == SERVER_ID)
                ctx = self._server_context(phase, round_index)
                state = self._receive(
                    lambda box: method.server_receive(exchange, self.server_state, box, ctx),
                    mine,
                    foreign,
                    exchange,
                )
                if state is not None:
                    self.server_state = state
        self.network.finish_exchange(exchange)

    def _account(
        self,
        outgoing: Messages,
        sent_sizes: torch.Tensor,
        inbox: Messages,
        inbox_sizes: torch.Tensor,
        exchange: str,
        round_index: int,
        broadcasts: bool,
    ) -> None:
        """Communication ledger: bytes each client sent and received over the network (a
        node does not send to itself over the network; the server, id -1, has no row)."""
        for messages, sizes, total, per_client, node in (
            (outgoing, sent_sizes, self._bytes_sent, self._sent, outgoing.src),
            (inbox, inbox_sizes, self._bytes_received, self._received, inbox.dst),
        ):
            if not len(messages):
                continue
            sizes = sizes.to(total.device)
            wire = (messages.src != messages.dst).to(total.device)
            total += (sizes * wire).sum()  # no host read: masks, not boolean indexing
            if (
                broadcasts and per_client is self._received
            ):  # every client but the sender got a copy
                per_client += broadcast_receipts(
                    exchange, round_index, messages, len(per_client)
                ).to(total.device)
                wire &= ~messages.is_broadcast().to(total.device)
            client = wire & (node.to(total.device) >= 0)
            per_client.index_add_(0, node.to(total.device).clamp_min(0), sizes * client)

    def _receive(
        self, receive: Callable[[Messages], State], inbox: Messages, foreign: bool, exchange: str
    ) -> State | None:
        """The new state; on an untrusted network a `receive` that fails on what other
        parties sent falls back to this process's own messages (None: keep the state)."""
        if not self.network.untrusted:
            return receive(inbox)
        try:
            return receive(inbox)
        except Exception:  # noqa: BLE001 - what other peers send must not stop this one
            self.receive_errors += 1
            self.network.receive_failed(exchange, len(inbox))
        if foreign:
            own = torch.isin(
                inbox.src, torch.cat([g.rows for g in self.groups] + [torch.tensor([SERVER_ID])])
            )
            try:
                return receive(inbox.select(own))
            except Exception:  # noqa: BLE001
                self.network.receive_failed(exchange, int(own.sum()))
        return None

    def _gate(self, group: ClientGroup, received: State) -> State:
        """The run's client-side gate (accept-if-better) on what `receive` changed."""
        assert self.job.defense is not None
        return gate_received(
            self.job.defense,
            self.method,
            self.job.model,
            group.train,
            group.state,
            received,
            self._metrics,
        )

    # -- attacks -----------------------------------------------------------------------
    def _group_outgoing(self, exchange: str, phase: Phase, round_index: int) -> list[Messages]:
        """Each group's messages of `exchange`, after the run's attack."""
        method, attack = self.method, self.job.attack
        outgoing = [
            method.outgoing(exchange, g.state, self._group_context(g, phase.name, round_index))
            for g in self.groups
        ]
        if attack is not None and attack.acts_in(phase.name):
            # omniscient attacks see every honest message this process holds (all of them in
            # the simulator and the in-process runtimes; none for a lone node on a device)
            knowledge = self._knowledge(outgoing) if attack.omniscient else [{} for _ in outgoing]
            outgoing = [
                self._tamper(
                    exchange, g, messages, method.update_reference(exchange, g.state), **known
                )
                if len(messages)
                else messages
                for g, messages, known in zip(self.groups, outgoing, knowledge)
            ]
        return outgoing

    def _is_malicious(self, messages: Messages) -> torch.Tensor:
        return (messages.src >= 0) & self._malicious[messages.src.clamp_min(0)]

    def _knowledge(self, outgoing: list[Messages]) -> list[dict[str, Messages]]:
        return attacker_knowledge(outgoing, self._is_malicious)

    def _tamper(
        self,
        exchange: str,
        group: ClientGroup,
        messages: Messages,
        reference: Params | None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        assert self.job.attack is not None  # asked only in attacked runs
        return tamper(
            self.job.attack,
            exchange,
            group.rows,
            group.attack_rng,
            messages,
            self._is_malicious(messages),
            reference,
            observed,
            colluding,
        )

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Each held client's deployed model (and the method's extra models) on its own
        test split, in client order; with a global test set (`--eval global|both`), the
        deployed model on it too (extra `global`)."""
        if not self.groups:
            return np.zeros(0), {}
        model, method, order = self.job.model, self.method, self._order()

        def on_every_client(params_of: Callable[[State], Params]) -> np.ndarray:
            parts = [
                accuracy(model, params_of(g.state), g.test.x, g.test.y, g.test.n)
                for g in self.groups
            ]
            return torch.cat(parts)[order].cpu().numpy()

        names = method.extra_models(self.groups[0].state).keys()

        def extra_model(name: str) -> Callable[[State], Params]:
            return lambda s: method.extra_models(s)[name]

        extra = {name: on_every_client(extra_model(name)) for name in names}
        for name in method.client_accuracies(self.groups[0].state):  # measured by the method itself
            extra[name] = (
                torch.cat([method.client_accuracies(g.state)[name] for g in self.groups])[order]
                .cpu()
                .numpy()
            )
        if method.test_metrics:
            parts = [
                test_metrics(
                    model,
                    method.deployed_params(g.state),
                    g.test.x,
                    g.test.y,
                    g.test.n,
                    method.test_metrics,
                )
                for g in self.groups
            ]
            for name in parts[0]:
                extra[name] = torch.cat([p[name] for p in parts])[order].cpu().numpy()
        held = self.job.data.global_test
        if (
            held is not None
        ):  # `--eval global|both`: every client's deployed model on the one held-out set
            scores = [
                shared_accuracy(model, method.deployed_params(g.state), held) for g in self.groups
            ]
            extra[GLOBAL_ACCURACY] = torch.cat(scores)[order].cpu().numpy()
        return on_every_client(method.deployed_params), extra

    def deployed_params(self) -> Params:
        if not self.groups:
            return {}
        stacked = cat_rows([self.method.deployed_params(g.state) for g in self.groups])
        order = self._order()
        return {k: v[order] for k, v in stacked.items()}
