"""The round driver: the one place that executes a method's phases, rounds and steps.

Every runtime runs this code; runtimes differ only in the `Network` they hand it and
in which clients this process holds (all of them in one batched group for the
simulator, one client per group for the reference and bytes runtimes, a single client
or only the server on a device peer). Local updates, outgoing messages, the run's
attack, delivery, defenses (inside `receive`), the DP mechanism of each group, the
communication ledger and evaluation are all driven here, so "the same protocol in
every runtime" holds by construction.

The clients it holds, their step contexts and their evaluation are `HeldClients`
(`p4bench.engine.held_clients`), the base of `RoundDriver`; a block's communication ledger
is a `TrafficLedger` (`p4bench.engine.traffic`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from p4bench.engine.attacking import attacker_knowledge, carries_updates, tamper
from p4bench.engine.chunking import memory_budget
from p4bench.engine.equivocation import equivocation_check
from p4bench.engine.evaluation import gate_received
from p4bench.engine.held_clients import STREAM_ATTACK, STREAM_TRAINING, ClientGroup, HeldClients
from p4bench.engine.memory import keep_freed_memory
from p4bench.engine.messages import Messages
from p4bench.engine.method import Exchange, LocalUpdate, Phase
from p4bench.engine.network import Network
from p4bench.engine.receive_gate import ReceiveGate
from p4bench.engine.schedule import (  # Block ... TimeBudget: defined here before
    Block,
    StopAfter,
    TimeBudget,
    budget_rule,
    schedule,
    stop_reason,
)
from p4bench.engine.state import State, put_rows, take_rows
from p4bench.engine.traffic import TrafficLedger
from p4bench.models import Params
from p4bench.records import Outcome, RoundReport
from p4bench.rng import SERVER_ID

if TYPE_CHECKING:
    from p4bench.engine.job import Job

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


class RoundDriver(HeldClients):
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
        self.network = network
        self.receive_errors = 0
        # broadcasts stay one message where the network delivers them so (in process)
        self._broadcasts = network.carry_broadcasts(job.data.num_clients)
        self._gates = job.defense is not None and job.defense.gates_clients
        super().__init__(
            job,
            group_rows,
            holds_server=holds_server,
            batched_gradients=batched_gradients,
            separate_parties=separate_parties,
        )
        # what every inbox is held to before `receive` (counts, finite values, ranges)
        self.receive_gate = ReceiveGate.for_job(job, self.rejections)
        # receivers compare signed digests of what must be identical (p4bench.engine.equivocation)
        rows = [g.rows for g in self.groups]
        self.equivocation = equivocation_check(
            job, network, self.rejections, rows, self.holds_server, self._broadcasts
        )
        self._holds_everyone = (
            sum(len(rows) for rows in group_rows) == job.data.num_clients
        )  # the method's stop rule needs all
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
        self._losses: list[torch.Tensor] = []
        self._traffic = TrafficLedger(self.job.data.num_clients)
        self._metrics = {}
        self.rejections.clear()
        self.equivocation.begin_block(self._traffic)
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
            bytes_sent=int(self._traffic.bytes_sent),
            bytes_received=int(self._traffic.bytes_received),
            client_bytes_sent=self._traffic.sent.cpu().numpy(),
            client_bytes_received=self._traffic.received.cpu().numpy(),
            extra_accuracy=extra,
            losses=losses.cpu().numpy(),
            metrics={**self._metrics, **self.rejections.metrics()},
        )

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
        self._traffic.account(
            outgoing,
            delivery.sent_sizes,
            delivery.inbox,
            delivery.inbox_sizes,
            exchange,
            round_index,
            broadcasts,
        )
        admitted = self.receive_gate.admit(exchange, phase.name, round_index, delivery.inbox)
        # signed digests compared across receivers where the method declares identical messages
        admitted = self.equivocation.admit(exchange, phase.name, round_index, outgoing, admitted)
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
        self.equivocation.finish_exchange(exchange)  # unless its check already did

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
