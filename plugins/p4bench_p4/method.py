"""P4: Personalized, Private, Peer-to-Peer learning (see ../shared/reference/p4.md).

Phase 1 (grouping, Algorithm 1): every client trains its proxy for one local epoch
with DP, sends it to H randomly sampled peers, who measure the L1 dissimilarity; every
client then shares its measurements with all peers and each runs the same deterministic
grouping on the same data (`grouping.form_groups`) with the run's public random stream.

Phase 2 (co-training, Algorithm 2), per group and round: the round's aggregator
(round-robin over the sorted members) samples floor(l * G) members; they run K local
steps on the same batches for both models (the proxy with the DP mechanism, the
private model without DP on (1 - beta) CE + beta KL(proxy || private)); they send their
proxy deltas to the aggregator, which filters them with the run's defense, averages
them, applies eta_g and sends the new proxy to every member. Each client deploys its
private model. In the first co-training round the aggregator's announce also carries
its proxy, and every member starts from it: deltas are then taken from the model they
are added to (otherwise each member's delta is relative to its own phase-1 proxy but
is added to the aggregator's).

The proxy's teacher (option `teacher`), a departure from the paper made for privacy:
the paper trains the proxy on (1 - alpha) CE + alpha KL(private || proxy), but the
private model is trained without DP on the same records, so one record changes the
private model and through it the clipped gradients of *other* records in every later
proxy step, also in batches without that record: the subsampled-Gaussian analysis
(sensitivity C, a step unaffected when the record is not sampled) does not hold, and
no accountant's epsilon is valid. So by default the proxy reads no non-DP teacher:
- `none` (default): alpha = 0 for the proxy, plain DP-SGD on CE. Chosen because it is
  the paper's proxy step minus the leaking term, runs on every fused path, and on
  digits at epsilon 8 (3 seeds) its private models reach 0.866 against 0.868 with
  `last-proxy` and 0.873 with the paper's uncertified teacher (docs/privacy-practice.md, Teachers);
- `last-proxy`: KL from the proxy as released at the start of the round (the group's
  last proxy), a DP output: post-processing, certified. Generic (autograd) path only;
- `private`: the paper's, kept for reproduction; the run's epsilon is reported
  uncertified.
The private model may distil from the proxy (beta): it is never released.

Everything is written through the engine interface (no simulator-only logic), so the
same code runs batched, per client, over bytes or on devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np
import torch

from p4bench.engine import (
    DEFAULT_EPSILON,
    Capabilities,
    Exchange,
    LocalUpdate,
    Messages,
    Method,
    Phase,
)
from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX, PayloadLayout, params_layout
from p4bench.engine.method import PlannedRelease, Step, StepContext
from p4bench.engine.state import State
from p4bench.engine.training import noble_local_lr
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.options import resolve_options
from p4bench_p4.cotraining_exchange import CHECKED, REJECTED, CotrainingExchanges
from p4bench_p4.fused import FusedCotraining
from p4bench_p4.grouping import collaboration_matrix, symmetric
from p4bench_p4.grouping_exchange import UNKNOWN, GroupingExchanges
from p4bench_p4.local_training import LocalCotraining
from p4bench_p4.options import (  # noqa: F401 - FUSED_MODES, TEACHERS re-exported
    FUSED_MODES,
    GROUP_SIZE_DEFAULTS,
    OPTIONS,
    TEACHERS,
)
from p4bench_p4.span import SpanCotraining

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

GROUPING, COTRAINING = "grouping", "cotraining"
UPDATE, MODEL = UPDATE_PREFIX, MODEL_PREFIX
# The grouping's M x M working set beyond the state, per pair of clients: the shared matrix
# (float32), its symmetric copy and the matching's (float32 each), masks; allocator slack included
GROUPING_BYTES_PER_PAIR = 24
ARTIFACT_MATRIX_CLIENTS = (
    1000  # above: groups.json without the M x M matrix, and no dissimilarity.png
)
# measured 53 B at 1,000-3,000 clients, 154 B at 10,000 (bench/scale.py); the plan takes 128


def __getattr__(name: str) -> float:
    """`UNKNOWN_SENT`, the old name of `UNKNOWN` (renamed after 0.1.0), with a warning."""
    if name == "UNKNOWN_SENT":
        import warnings

        warnings.warn(
            "p4bench_p4.method.UNKNOWN_SENT is deprecated: use UNKNOWN (the same -1.0, now also in "
            "the state)",
            DeprecationWarning,
            stacklevel=2,
        )
        return UNKNOWN
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class GroupsRecord(TypedDict):
    """groups.json, as `P4.write_artifacts` writes it."""

    grouping: str
    target_size: int
    groups: list[list[int]]
    sizes: list[int]
    collaboration_matrix: NotRequired[list[list[int]]]  # up to ARTIFACT_MATRIX_CLIENTS clients


class P4(GroupingExchanges, CotrainingExchanges, LocalCotraining, Method):
    """P4 with its options (``-o key=value``): group_size V, samples H, teacher
    (none | last-proxy | private) and alpha (its weight), beta, grouping (similarity |
    random), proxy (true | false: one shared DP model)."""

    name = "p4"
    description = "P4: private similarity grouping, then DP proxy / private co-training with mutual distillation"
    capabilities = Capabilities(
        shares_individual_updates=True,
        has_aggregator=True,
        personalized=True,
        peer_aggregator=True,
    )
    default_neighbouring = "replace-one"  # the paper's eq. 13: noise std 2 C sigma
    default_defense = "p4-secure"
    default_epsilon = DEFAULT_EPSILON
    options = OPTIONS

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        default_size = min(
            GROUP_SIZE_DEFAULTS.get(config.dataset, 4), config.clients
        )  # small runs: one group
        self.group_size = values["group_size"] if values["group_size"] is not None else default_size
        self.samples = (
            values["samples"] if values["samples"] is not None else min(35, config.clients - 1)
        )
        self.teacher: str = values["teacher"]
        if self.teacher == "none" and (values["alpha"] or 0.0) > 0:
            raise ConfigError(
                "options.alpha",
                "weights the proxy's teacher: set -o teacher=last-proxy|private (default none: alpha = 0)",
            )
        self.alpha: float = (
            (values["alpha"] if values["alpha"] is not None else 0.5)
            if self.teacher != "none"
            else 0.0
        )
        self.beta: float = values["beta"]
        self.use_proxy: bool = values["proxy"]
        self.grouping = values["grouping"]
        # linear models: a fused step (same math, fewer passes), auto-chosen by FLOPs unless forced
        self.fused: str = {"true": "auto", "false": "off"}.get(values["fused"], values["fused"])
        self.span_noise: str = values["span_noise"]
        self.aggregator_check: str = values["aggregator_check"]
        self.aggregator_tolerance: float = values["aggregator_tolerance"]
        self.private_tf32: bool = values["private_precision"] == "tf32"
        # ranges that depend on the run
        if not 1 <= self.group_size <= config.clients:
            raise ConfigError(
                "options.group_size", f"must be in [1, {config.clients}], got {self.group_size}"
            )
        if not 1 <= self.samples <= config.clients - 1:
            raise ConfigError(
                "options.samples", f"must be in [1, {config.clients - 1}], got {self.samples}"
            )
        # Local step size as in Noble et al.'s code, which P4 builds on.
        self.local_lr = noble_local_lr(config)
        self.epoch_steps = math.ceil(1 / config.data_rate)
        if self.teacher == "last-proxy" and self.fused in ("span", "buckets"):
            raise ConfigError(
                "options.fused", "teacher=last-proxy runs on the generic path only (-o fused=false)"
            )
        self._buckets = FusedCotraining(self.alpha, self.beta, self.local_lr, config.data_rate)
        self._span = SpanCotraining(
            self.alpha, self.beta, self.local_lr, config.data_rate, self.span_noise
        )

    def uncertified_steps(self) -> list[str]:
        if self.teacher == "private" and self.use_proxy and self.alpha > 0:
            return [
                "P4 teacher=private (the paper's): the DP proxy distils from the non-DP private model trained "
                "on the same records, so one record moves other records' clipped gradients outside the ledger"
            ]
        return []

    # -- schedule ---------------------------------------------------------------------
    def phases(self) -> list[Phase]:
        return [Phase(GROUPING, 1), Phase(COTRAINING, self.config.rounds)]

    def round_steps(self, phase: Phase, round_index: int) -> tuple[Step, ...]:
        if phase.name == GROUPING:
            return (LocalUpdate(), Exchange("probe"), Exchange("share"))
        return (Exchange("announce"), LocalUpdate(), Exchange("upload"), Exchange("distribute"))

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        rounds = math.ceil(c.client_rate * c.rounds)
        return [
            PlannedRelease(GROUPING, c.data_rate, self.epoch_steps, self.epoch_steps, 1, 1.0),
            PlannedRelease(
                COTRAINING,
                c.data_rate,
                c.local_steps * rounds,
                c.local_steps,
                c.rounds,
                c.client_rate,
            ),
        ]

    # -- state ------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        init = {k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()}
        return {
            "proxy": init,
            "private": {k: v.clone() for k, v in init.items()},
            "group_proxy": {k: v.clone() for k, v in init.items()},
            "known": torch.full((count, self.num_clients), UNKNOWN),
            "members": torch.zeros(count, self.num_clients, dtype=torch.bool),
            "selected": torch.zeros(count, dtype=torch.bool),
            "trained": torch.zeros(count, dtype=torch.bool),
            "stopped": torch.zeros(count, dtype=torch.bool),
            # device runtime faults: members this row saw miss their aggregator turn, and
            # the aggregator it follows this round (-1: none announced)
            "failed": torch.zeros(count, self.num_clients, dtype=torch.bool),
            "lead": torch.full((count,), -1, dtype=torch.long),
        }

    def deployed_params(self, state: State) -> Params:
        params: Params = state["private"] if self.use_proxy else state["proxy"]
        return params

    def extra_models(self, state: State) -> dict[str, Params]:
        return {"proxy": state["proxy"]} if self.use_proxy else {}

    # a client that joins after training (--unseen-fraction): the private models never leave
    # their clients and are trained without DP, so a newcomer starts from the proxies' mean
    newcomer_start = "the mean of the trained clients' proxies"

    def newcomer_params(self, state: State) -> Params:
        return {k: v.mean(0) for k, v in state["proxy"].items()}

    def participants(self, state: State, ctx: StepContext) -> torch.Tensor:
        if ctx.phase == GROUPING:
            return torch.ones(len(ctx.rows), dtype=torch.bool)
        selected: torch.Tensor = state["selected"] & ~state["stopped"]
        return selected

    # -- local computation -----------------------------------------------------------
    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        if ctx.phase == GROUPING:
            return self._proxy_epoch(state, train, ctx)
        return self._cotrain(state, train, ctx)

    # -- messages: phase 1 in GroupingExchanges, phase 2 in CotrainingExchanges ----------------
    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        send: Callable[[State, StepContext], Messages] = getattr(self, f"_send_{exchange}")
        return send(state, ctx)

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        handle: Callable[[State, Messages, StepContext], State] = getattr(
            self, f"_receive_{exchange}"
        )
        return handle(state, inbox, ctx)

    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]:
        """With aggregator_check=recompute a participant's upload goes to every member, who
        all recompute the aggregate from it: it must be the same for every receiver, else a
        participant sending different deltas would make the members' aggregates differ
        from the aggregator's and frame an honest aggregator (the equivocation check names
        and drops such a sender). Declared only where the run sets option `equivocation`
        itself: the check's digest reports go from every node to every node, O(N^3) bytes
        per exchange, prohibitive at the paper's client counts. A `distribute` that
        differs between members is caught by each member's own comparison."""
        asked = "equivocation" in self.config.options
        return asked and self.aggregator_check == "recompute" and exchange == "upload"

    def derived_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """How far members checked their aggregators: with aggregator_check=recompute the
        distributed models compared and rejected; 0 checked says the run trusted them."""
        return {name: float(totals.get(name, 0.0)) for name in (CHECKED, REJECTED)}

    def update_reference(self, exchange: str, state: State) -> Params | None:
        return state["group_proxy"] if exchange == "upload" else None

    def working_bytes(self, num_clients: int) -> int:
        """The grouping's M x M matrices (GROUPING_BYTES_PER_PAIR per pair of clients); its
        share exchange is one broadcast per client, not one message per pair."""
        return num_clients * num_clients * GROUPING_BYTES_PER_PAIR

    def payload_bounds(
        self, exchange: str, phase: str, round_index: int
    ) -> dict[str, tuple[float, float]]:
        """Shared distances are L1 distances (>= 0), or -1 where unknown."""
        return {"known": (UNKNOWN, float("inf"))} if exchange == "share" else {}

    def message_layout(self, exchange: str, phase: str, round_index: int) -> PayloadLayout | None:
        """Declared, since members receive `distribute` (and `announce`) without sending in it."""
        proxy = self.initial_params()
        layouts: dict[str, Callable[[], PayloadLayout]] = {
            "probe": lambda: params_layout(proxy, UPDATE),
            "share": lambda: {"known": (torch.float32, (self.num_clients,))},
            "announce": lambda: {
                "selected": (torch.bool, ()),
                **(params_layout(proxy, MODEL) if round_index == 0 else {}),
            },
            "upload": lambda: params_layout(proxy, UPDATE),
            "distribute": lambda: params_layout(proxy, MODEL),
        }
        return layouts[exchange]() if exchange in layouts else None

    # -- reporting ------------------------------------------------------------------------
    def groups_of(self, state: State) -> list[list[int]]:
        """Distinct groups as seen by the clients (for artifacts and tests)."""
        seen = {tuple(row.nonzero().squeeze(1).tolist()) for row in state["members"]}
        return sorted(list(g) for g in seen if g)

    def write_artifacts(self, state: State, folder: Path) -> list[Path]:
        """groups.json (groups, sizes and, up to ARTIFACT_MATRIX_CLIENTS clients, the
        collaboration matrix) and, up to that size, dissimilarity.png (the sampled L1
        dissimilarities, clients ordered by group): an M x M matrix as JSON or pixels is
        GBs at the paper's 2,080 clients and beyond, and the groups say the same."""
        groups = self.groups_of(state)
        small = self.num_clients <= ARTIFACT_MATRIX_CLIENTS
        record: GroupsRecord = {
            "grouping": self.grouping,
            "target_size": self.group_size,
            "groups": groups,
            "sizes": [len(g) for g in groups],
        }
        if small:
            record["collaboration_matrix"] = collaboration_matrix(groups, self.num_clients).tolist()
        (folder / "groups.json").write_text(json.dumps(record))
        if not small:
            return [folder / "groups.json"]
        dissimilarity = symmetric(state["known"].cpu().numpy())
        order = [c for g in groups for c in g]
        _plot_dissimilarity(
            dissimilarity[np.ix_(order, order)],
            [len(g) for g in groups],
            folder / "dissimilarity.png",
        )
        return [folder / "groups.json", folder / "dissimilarity.png"]


def _plot_dissimilarity(values: np.ndarray, sizes: list[int], path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    figure = Figure(figsize=(6, 5))
    axes = figure.add_subplot()
    shown = np.where(np.isfinite(values), values, np.nan)
    image = axes.imshow(shown, interpolation="nearest", cmap="viridis_r")
    figure.colorbar(
        image, ax=axes, label="L1 dissimilarity of phase-1 proxies (blank: not sampled)"
    )
    edge = -0.5
    for size in sizes:  # outline each group on the diagonal
        axes.add_patch(
            Rectangle((edge, edge), size, size, fill=False, edgecolor="red", linewidth=1)
        )
        edge += size
    axes.set_xlabel("client (ordered by group)")
    axes.set_ylabel("client (ordered by group)")
    axes.set_title("P4 phase 1: sampled dissimilarities and groups")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
