"""The clients (and server) one process holds in a run: their groups (rows, state, data,
random streams, DP mechanism), the `StepContext` a method's step gets for them, and
their evaluation. `RoundDriver` (`p4bench.engine.driver`) drives them through the schedule.

How the clients are grouped is the runtime's choice: all of them in one batched group in
the simulator, one client per group in the reference and bytes runtimes, a single client
or only the server on a device peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from p4bench.engine.attacking import poison
from p4bench.engine.evaluation import test_metrics
from p4bench.engine.method import Phase, StepContext
from p4bench.engine.receive_gate import Rejections
from p4bench.engine.state import State, cat_rows, take_rows
from p4bench.engine.threats import Aggregator
from p4bench.engine.training import (
    accuracy,
    batched_loss_and_grad,
    reference_loss_and_grad,
    shared_accuracy,
)
from p4bench.models import Params
from p4bench.records import GLOBAL_ACCURACY
from p4bench.rng import SERVER_ID, ClientRng, client_rng, node_keys, secret_draws

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.job import Job
    from p4bench.privacy.mechanism import DPMechanism

__all__ = ["ClientGroup", "HeldClients", "STREAM_ATTACK", "STREAM_TRAINING"]

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


class HeldClients:
    """The client groups (`group_rows`) and the server this process holds, their states
    initialised by the run's method."""

    def __init__(
        self,
        job: Job,
        group_rows: Sequence[torch.Tensor],
        *,
        holds_server: bool,
        batched_gradients: bool = True,
        separate_parties: bool = False,
    ) -> None:
        self.job = job
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
        # the block's rejected messages (the receive gate's, and a method's own through
        # `StepContext.reject`), counted per block and reported in its metrics
        self.rejections = Rejections()
        # what the method writes to `ctx.metrics` in a block (e.g. FedDF's server distillation
        # steps and seconds): reported with the block's RoundReport.metrics
        self._metrics: dict[str, float] = {}
        self.groups = [self._make_group(rows) for rows in group_rows]
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
