"""The method interface: per-client logic plus an exchange schedule.

A method is written once and every runtime executes it: the batched simulator hands
it all clients stacked along a leading axis, one-client-per-process runtimes hand it a
single row. State is a nested dict of tensors with that leading client axis; messages
are `Messages` values. Randomness comes from `ctx.rng` (each row its own stream) and
gradients from `ctx.loss_and_grad`, so the runtime decides how they are computed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from p4bench.engine.capabilities import (
    Capabilities as Capabilities,
)  # re-exported: it was defined here
from p4bench.engine.messages import Messages, PayloadLayout
from p4bench.engine.receive_gate import Rejections
from p4bench.engine.state import State
from p4bench.engine.training import LossAndGrad
from p4bench.models import Model, Params
from p4bench.rng import ClientRng

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import ClientTensors
    from p4bench.data.public import PublicData
    from p4bench.engine.threats import Aggregator
    from p4bench.options import Option
    from p4bench.privacy.mechanism import DPMechanism, DPSettings
    from p4bench.privacy.network_events import NetworkEvent


DEFAULT_EPSILON = 8.0
"""The suite-wide target epsilon of DP methods that run private by default: one value,
so that default runs of different DP methods compare at equal privacy."""


@dataclass(frozen=True)
class LocalUpdate:
    """Step: participating clients compute (`Method.local_update`)."""


@dataclass(frozen=True)
class Exchange:
    """Step: every node sends (`outgoing`), messages are delivered, every node `receive`s."""

    name: str


Step = LocalUpdate | Exchange


@dataclass(frozen=True)
class Phase:
    """A named stretch of rounds; `setup` steps run once before its first round."""

    name: str
    rounds: int
    setup: tuple[Step, ...] = ()


@dataclass(frozen=True)
class PlannedRelease:
    """The noisy releases a method plans for one client in one phase; used to calibrate
    the noise multiplier from a target epsilon and by bounds that need the schedule."""

    phase: str
    sample_rate: float
    steps: int  # DP steps a typical client takes in the phase
    local_steps: int = 1  # K, steps per round
    rounds: int = 1  # T, rounds of the phase
    client_rate: float = 1.0  # l, fraction of clients taking part per round


@dataclass
class StepContext:
    """What a method may use inside one step. Built by the runtime."""

    config: RunConfig
    model: Model
    phase: str
    round: int
    rows: torch.Tensor  # global node ids of the state rows (-1 = server)
    rng: ClientRng
    loss_and_grad: LossAndGrad
    aggregator: Aggregator
    num_clients: int
    dp: DPMechanism | None = None  # set when the run is private
    metrics: dict[str, float] = field(default_factory=dict)
    # The run's DP settings (clip, noise multiplier, relation; None without DP): public, the
    # same in every process, and also in the server's steps, which have no mechanism. A
    # party that adds noise for others (a central server) reads the std here, never from
    # what the clients send.
    dp_settings: DPSettings | None = None
    # The rows' own training records (what `local_update` gets as `train`), also in exchange
    # steps: a client may score what it received on its own data (P4L's accept-if-better).
    train: ClientTensors | None = None
    # Where the receive gate's and the method's rejections are counted (`reject`).
    rejections: Rejections | None = None

    def reject(self, reason: str, senders: torch.Tensor) -> None:
        """Count one rejected message per sender id in `senders`, for a check only the
        method can make (e.g. a declared weight that changed): reported with the receive
        gate's rejections as ``rejected <reason> from <id>``. The method itself leaves
        those messages out of what it computes."""
        if self.rejections is not None and len(senders):
            self.rejections.add(reason, senders)


class Method(ABC):
    """Base class of every method plugin.

    Subclasses set `name`, `description`, `capabilities` and implement
    `init_client_state`, `local_update` and `deployed_params`; exchange-based methods
    also implement `outgoing`/`receive` (and the `server_*` pair when they use a server).
    They declare their `config.options` keys in `options` and read typed values with
    `p4bench.options.resolve_options(self.options, self.config.options)`.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    default_neighbouring: ClassVar[str] = "add-remove"
    default_defense: ClassVar[str | None] = None  # used when the run names no defense
    # A DP method runs private at this target epsilon unless the run gives its own
    # epsilon or noise multiplier, or opts out with `no_dp` (None: non-private by default).
    default_epsilon: ClassVar[float | None] = None
    options: ClassVar[tuple[Option, ...]] = ()  # declared `config.options` keys (p4bench.options)
    # The core run options its training reads that a paper's grid may vary ("local_steps",
    # "data_rate", "client_rate", "clip"; None: all): `p4bench reproduce` tunes only these,
    # so no tuning run is spent on an option the method ignores (p4bench.studies.tune_axes).
    tuning_options: ClassVar[tuple[str, ...] | None] = None
    # A method that reads unlabeled public data (FedDF's server distillation) sets this and
    # declares p4bench.data.public.PUBLIC_DATA_OPTIONS; the runner then holds the data out of
    # the clients' records and sets `public_data` before training (None for other methods).
    needs_public_data: ClassVar[bool] = False
    needs_public_labels: ClassVar[bool] = (
        False  # ... and its labels (a held-out labeled pool, e.g. PDSL's Q)
    )
    public_data: PublicData | None = None
    # Besides accuracy, the harness measures these on each client's test split after every
    # round ("loss": mean cross-entropy, "auc": macro one-vs-rest ROC AUC), reported as
    # the per-client values `test_loss` / `test_auc` (P4L's metrics by participation count).
    test_metrics: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: RunConfig, model: Model, num_clients: int) -> None:
        self.config = config
        self.model = model
        self.num_clients = num_clients
        self.validate_options()

    # -- configuration -----------------------------------------------------------------
    def validate_options(self) -> None:
        """Read the declared `options` (resolve_options) and check what declarations cannot
        (cross-field rules, ranges that depend on the run); raise ConfigError on bad values."""

    def initial_params(self) -> Params:
        """The common initialisation every client starts from (a function of the seed only)."""
        with torch.device("cpu"):  # drawn on the host, so every device starts from the same numbers
            params = self.model.init(torch.Generator().manual_seed(self.config.seed))
        device = torch.get_default_device()
        return {name: value.to(device) for name, value in params.items()}

    def uncertified_steps(self) -> list[str]:
        """Reasons the run's epsilon would not hold with the configured options: each a
        data-dependent step outside the ledger (e.g. a DP step that reads a non-DP model
        trained on the same records). Empty when every step that touches the data is a
        ledger release or post-processing of releases and public values."""
        return []

    def privacy_plan(self) -> list[PlannedRelease]:
        """Planned DP releases per client (default: K steps in each of ceil(l*T) rounds)."""
        c = self.config
        participations = math.ceil(c.client_rate * c.rounds)
        return [
            PlannedRelease(
                "train",
                c.data_rate,
                c.local_steps * participations,
                c.local_steps,
                c.rounds,
                c.client_rate,
            )
        ]

    # -- schedule --------------------------------------------------------------------
    def phases(self) -> list[Phase]:
        return [Phase("train", self.config.rounds)]

    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return (LocalUpdate(),)

    # -- client side -----------------------------------------------------------------
    @abstractmethod
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        """Initial state of the clients in `ctx.rows` (leading axis = those clients)."""

    def participants(self, state: State, ctx: StepContext) -> torch.Tensor:
        """(C,) bool: which rows run `local_update` in this step (default: all)."""
        return torch.ones(len(ctx.rows), dtype=torch.bool)

    @abstractmethod
    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        """Train the participating rows; return the new state and each row's mean loss."""

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        return Messages.empty()

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        """Handle the messages addressed to these rows (sorted by destination, then source)."""
        return state

    @abstractmethod
    def deployed_params(self, state: State) -> Params:
        """The parameters each client would deploy (evaluated on its own test split)."""

    def message_layout(self, exchange: str, phase: str, round_index: int) -> PayloadLayout | None:
        """The payload layout every honest sender uses in `exchange` of this round: key ->
        (dtype, shape of one message's tensor); see `p4bench.engine.messages.params_layout`.
        A transport between untrusted peers (the device runtime) drops all of a sender's
        messages in an exchange when any differs, naming the sender. None (the default):
        not declared; the transport then holds senders to the layout of this node's own
        messages in the exchange, and where it sent none, only to their own consistency.
        Declare it for exchanges where some nodes only receive (a server's upload, a
        group's distribution): there no vote among senders decides what is valid."""
        return None

    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]:
        """Whether every receiver of one sender in `exchange` gets the same message: True
        (every payload entry), the payload keys that are the same (a frozenset), or False
        (the default: messages are per receiver, nothing is compared). Declare it for
        broadcasts and for gossip of one model to every neighbour: the round driver then
        runs the equivocation check (`p4bench.engine.equivocation`), in which receivers
        compare signed digests of what each sender sent them and name a sender that sent
        different ones. Never declare it where honest senders send per-receiver values
        (per-receiver noise or weights): honest senders would be named."""
        return False

    def network_events(
        self, exchange: str, phase: str, round_index: int, occurrence: int
    ) -> Sequence[NetworkEvent] | None:
        """What the network-DP accountant (`p4bench.privacy.network_dp`) counts for the
        `occurrence`-th (0-based) `exchange` of this round: the `Release`s that entered the
        nodes' states since the previous exchange, then the `Gossip` whose matrix is this
        exchange's exact mixing (`p4bench.privacy.network_events`; a release's noise
        multiplier NaN: the run's mechanism's). Every exchange of the
        run must be declared; the run's mixing check holds each message to its sender's
        declared state. None (the default): not declared, network DP "not applicable"."""
        return None

    def network_dp_unavailable(self) -> str | None:
        """Why this run's messages are not linear mixtures of releases (a nonlinear defense,
        a tracker of release differences), said in the summary's ``network_dp``."""
        return None

    def working_bytes(self, num_clients: int) -> int:
        """Bytes the method's own work needs at once beyond its clients' state and the DP
        step (e.g. P4's grouping: one message per pair of clients), for the memory plan;
        default 0."""
        return 0

    def messages_per_pair(self, exchange: str, phase: str, round_index: int) -> int:
        """At most this many messages from one sender to one destination in `exchange`
        (default 1): the receive gate (`p4bench.engine.receive_gate`) rejects the extras,
        so a sender cannot outvote others with copies. Override where an honest sender
        sends more."""
        return 1

    def server_messages_per_pair(self, exchange: str, phase: str, round_index: int) -> int:
        """`messages_per_pair` for the server's messages (default 1)."""
        return 1

    def payload_bounds(
        self, exchange: str, phase: str, round_index: int
    ) -> dict[str, tuple[float, float]]:
        """Payload key -> inclusive (low, high) every element of an honest message's entry
        lies in; the receive gate rejects messages outside them. Default: none besides the
        gate's own (finite values; the conventional ``weight`` in [0, N])."""
        return {}

    def update_reference(self, exchange: str, state: State) -> Params | None:
        """The model the ``update.*`` payloads of `exchange` are deltas from (per row),
        or None when they carry models. Model-replacement attacks need it."""
        return None

    def write_artifacts(self, state: State, folder: Path) -> list[Path]:
        """Write method-specific result files (e.g. P4's groups) for the run's artifacts."""
        return []

    def extra_models(self, state: State) -> dict[str, Params]:
        """Other per-client models worth evaluating and logging (e.g. P4's proxy)."""
        return {}

    # `newcomer_params` in words, for the summary (`unseen_fine_tune.start`)
    newcomer_start: ClassVar[str] = "the mean of the trained clients' deployed models"

    def newcomer_params(self, state: State) -> Params:
        """The model a client that joins after training starts from (`--unseen-fraction`),
        one set of parameters (no client axis), from the trained clients' final state. It
        should be a function of the method's releases, so that their epsilon covers it: the
        default, the mean of the deployed models, is one where those are trained by DP steps
        and mixing only; a method that deploys a model trained without DP (P4's and
        ProxyFL's private models) starts newcomers from its shared one (their proxies)."""
        return {k: v.mean(0) for k, v in self.deployed_params(state).items()}

    def client_accuracies(self, state: State) -> dict[str, torch.Tensor]:
        """Accuracies the method measures itself, (C,) per name (e.g. p2p-fl's pre- and
        post-fit accuracy on each client's validation split): reported after every round
        with the extra models' (`RoundReport.extra_accuracy`, metric accuracy_<name>_mean)."""
        return {}

    def privacy_context(self) -> dict[str, Any]:
        """Who observes each client's releases (e.g. {"receivers_per_release": M - 1}),
        added to a private run's summary; empty when the method declares nothing."""
        return {}

    def derived_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Metrics derived from a round's summed `ctx.metrics` counters (e.g. a completion
        rate from completed and started counts). The harness applies it to every round's
        metrics once they are summed over all processes (device peers report raw sums)."""
        return {}

    def finished(self, extra: dict[str, Any]) -> bool:
        """Whether the run is done after a round, from the round's per-client values
        (`RoundReport.extra_accuracy`, all clients; e.g. P4L's mrt/mrr rule). Asked
        where every client's values are known: the simulator's driver, the device launcher."""
        return False

    # -- server side (only when capabilities.uses_server) -----------------------------
    def init_server_state(self, ctx: StepContext) -> State:
        return {}

    def server_outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        return Messages.empty()

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        return state

    # -- the receive gate's freshness check ---------------------------------------------
    def fresh_payloads(self, exchange: str, phase: str, round_index: int) -> bool:
        """Whether every honest ``update.*`` payload of `exchange` in this round is new: a
        model that went through a DP release with fresh noise since the sender's last
        message of the exchange, so that it never repeats bit for bit its sender's earlier
        message nor another sender's. Declared True, the receive gate rejects a repeat as
        ``stale payload`` or ``copied payload`` naming the sender
        (`p4bench.engine.payload_history`). Default False: models that honestly repeat (a
        client not sampled, a relay forwarding others', the first round's common start,
        runs without DP) must not be declared."""
        return False
