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
  `last-proxy` and 0.873 with the paper's uncertified teacher (README, Privacy);
- `last-proxy`: KL from the proxy as released at the start of the round (the group's
  last proxy), a DP output: post-processing, certified. Generic (autograd) path only;
- `private`: the paper's, kept for reproduction; the run's epsilon is reported
  uncertified.
The private model may distil from the proxy (beta): it is never released.

Everything is written through the engine interface (no simulator-only logic), so the
same code runs batched, per client, over bytes or on devices.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache

import numpy as np
import torch

from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Messages, Method, Phase
from p4bench.engine.messages import BROADCAST, MODEL_PREFIX, UPDATE_PREFIX, params_layout
from p4bench.engine.method import PlannedRelease
from p4bench.engine.state import flatten, strip_prefix, unvectorize, vectorize
from p4bench.engine.training import batch_gradient, gather_batch, logits_of, noble_local_lr, sample_batches
from p4bench.errors import ConfigError
from p4bench.models import LinearSoftmax
from p4bench.options import Option, resolve_options
from p4bench.plugins.p4.fused import FusedCotraining, LinearCotraining
from p4bench.plugins.p4.grouping import collaboration_matrix, form_groups, random_groups, symmetric
from p4bench.plugins.p4.losses import distillation_loss
from p4bench.plugins.p4.span import NOISE_MODES, SpanCotraining, span_fits, span_is_cheaper
from p4bench.privacy.mechanism import input_statistics

GROUPING, COTRAINING = "grouping", "cotraining"
UPDATE, MODEL = UPDATE_PREFIX, MODEL_PREFIX
GROUP_SIZE_DEFAULTS = {"cifar10": 8, "femnist": 8, "leaf-femnist": 8, "cifar100": 4}
FUSED_MODES = ("auto", "span", "buckets", "off")
TEACHERS = ("none", "last-proxy", "private")
_PUBLIC_SEED = 13  # stream for the grouping's random pairs, shared by every client
# The grouping's M x M working set beyond the state, per pair of clients: the shared matrix
# (float32), its symmetric copy and the matching's (float32 each), masks; allocator slack included
GROUPING_BYTES_PER_PAIR = 24
ARTIFACT_MATRIX_CLIENTS = 1000  # above: groups.json without the M x M matrix, and no dissimilarity.png
# measured 53 B at 1,000-3,000 clients, 154 B at 10,000 (bench/scale.py); the plan takes 128
UNKNOWN = -1.0  # a distance not (yet) measured, in the state and on the wire (every value sent is finite)


def __getattr__(name: str):
    """`UNKNOWN_SENT`, the old name of `UNKNOWN` (renamed after 0.1.0), with a warning."""
    if name == "UNKNOWN_SENT":
        import warnings

        warnings.warn("p4bench.plugins.p4.method.UNKNOWN_SENT is deprecated: use UNKNOWN (the same -1.0, now also in "
                      "the state)", DeprecationWarning, stacklevel=2)
        return UNKNOWN
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _same_as_first(inbox: Messages, key: str, first: torch.Tensor) -> bool:
    """Whether every message's `key` row equals that of its sender's first message
    (`first`: inbox position per sender). Messages that carry the very table row of that
    first message (the simulator's: a sender's share is stored once) are equal without a
    look; the others are compared in chunks, so no (messages x M) copy is made."""
    table, rows = inbox.table[key], inbox.table_rows()
    reference = rows[first[inbox.src]]
    differ = (reference != rows).nonzero().squeeze(1)
    chunk = max(1, (1 << 24) // max(table.shape[1], 1))
    for start in range(0, len(differ), chunk):
        part = differ[start : start + chunk]
        if not torch.equal(table[rows[part]], table[reference[part]]):
            return False
    return True


def _group_labels(groups: list[list[int]], count: int) -> np.ndarray:
    """(count,) each client's group index, -1 for a client in no group."""
    label = np.full(count, -1, dtype=np.int64)
    for index, group in enumerate(groups):
        label[np.asarray(group, dtype=np.int64)] = index
    return label


class P4(Method):
    """P4 with its options (``-o key=value``): group_size V, samples H, teacher
    (none | last-proxy | private) and alpha (its weight), beta, grouping (similarity |
    random), proxy (true | false: one shared DP model)."""

    name = "p4"
    description = "P4: private similarity grouping, then DP proxy / private co-training with mutual distillation"
    capabilities = Capabilities(shares_individual_updates=True, has_aggregator=True, personalized=True)
    default_neighbouring = "replace-one"  # the paper's eq. 13: noise std 2 C sigma
    default_defense = "p4-secure"
    default_epsilon = DEFAULT_EPSILON
    options = (
        Option("group_size", int, None, "V, clients per group; default: 8 for cifar10/femnist/leaf-femnist, 4 for "
               "others (at most M)", low=1),
        Option("samples", int, None, "H, peers each client probes in phase 1; default: min(35, M-1)", low=1, paper="35 probes, section VI"),
        Option("teacher", str, "none", "what the DP proxy distils from: none (CE alone), last-proxy (the group's last "
               "released proxy) or private (the paper's non-DP model: epsilon uncertified)", choices=TEACHERS),
        Option("alpha", float, None, "the proxy's distillation weight; default: 0.5 with a teacher, 0 without (a "
               "positive alpha needs a teacher)", low=0, high=1),
        Option("beta", float, 0.5, "the private model's distillation weight", low=0, high=1),
        Option("grouping", str, "similarity", "phase 1: similarity grouping, or random groups (ablation)",
               choices=("similarity", "random")),
        Option("proxy", bool, True, "false: one shared DP model instead of proxy + private (ablation)"),
        Option("fused", str, "auto", "linear models: auto picks by FLOPs between the span and the bucketed fused "
               "step; off runs the generic autograd step (true = auto, false = off)",
               choices=FUSED_MODES + ("true", "false")),
        Option("span_noise", str, "basis", "span path DP noise: basis (through an orthonormal basis of the client's "
               "data, same distribution) or streams (the generic path's numbers)", choices=NOISE_MODES),
    )

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        default_size = min(GROUP_SIZE_DEFAULTS.get(config.dataset, 4), config.clients)  # small runs: one group
        self.group_size = values["group_size"] if values["group_size"] is not None else default_size
        self.samples = values["samples"] if values["samples"] is not None else min(35, config.clients - 1)
        self.teacher = values["teacher"]
        if self.teacher == "none" and (values["alpha"] or 0.0) > 0:
            raise ConfigError("options.alpha", "weights the proxy's teacher: set -o teacher=last-proxy|private (default none: alpha = 0)")
        self.alpha = (values["alpha"] if values["alpha"] is not None else 0.5) if self.teacher != "none" else 0.0
        self.beta, self.grouping, self.use_proxy = values["beta"], values["grouping"], values["proxy"]
        # linear models: a fused step (same math, fewer passes), auto-chosen by FLOPs unless forced
        self.fused = {"true": "auto", "false": "off"}.get(values["fused"], values["fused"])
        self.span_noise = values["span_noise"]
        # ranges that depend on the run
        if not 1 <= self.group_size <= config.clients:
            raise ConfigError("options.group_size", f"must be in [1, {config.clients}], got {self.group_size}")
        if not 1 <= self.samples <= config.clients - 1:
            raise ConfigError("options.samples", f"must be in [1, {config.clients - 1}], got {self.samples}")
        # Local step size as in Noble et al.'s code, which P4 builds on.
        self.local_lr = noble_local_lr(config)
        self.epoch_steps = math.ceil(1 / config.data_rate)
        if self.teacher == "last-proxy" and self.fused in ("span", "buckets"):
            raise ConfigError("options.fused", "teacher=last-proxy runs on the generic path only (-o fused=false)")
        self._buckets = FusedCotraining(self.alpha, self.beta, self.local_lr, config.data_rate)
        self._span = SpanCotraining(self.alpha, self.beta, self.local_lr, config.data_rate, self.span_noise)

    def uncertified_steps(self):
        if self.teacher == "private" and self.use_proxy and self.alpha > 0:
            return [
                "P4 teacher=private (the paper's): the DP proxy distils from the non-DP private model trained "
                "on the same records, so one record moves other records' clipped gradients outside the ledger"
            ]
        return []

    # -- schedule ---------------------------------------------------------------------
    def phases(self):
        return [Phase(GROUPING, 1), Phase(COTRAINING, self.config.rounds)]

    def round_steps(self, phase, round_index):
        if phase.name == GROUPING:
            return (LocalUpdate(), Exchange("probe"), Exchange("share"))
        return (Exchange("announce"), LocalUpdate(), Exchange("upload"), Exchange("distribute"))

    def privacy_plan(self):
        c = self.config
        rounds = math.ceil(c.client_rate * c.rounds)
        return [
            PlannedRelease(GROUPING, c.data_rate, self.epoch_steps, self.epoch_steps, 1, 1.0),
            PlannedRelease(COTRAINING, c.data_rate, c.local_steps * rounds, c.local_steps, c.rounds, c.client_rate),
        ]

    # -- state ------------------------------------------------------------------------
    def init_client_state(self, train, ctx):
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

    def deployed_params(self, state):
        return state["private"] if self.use_proxy else state["proxy"]

    def extra_models(self, state):
        return {"proxy": state["proxy"]} if self.use_proxy else {}

    def participants(self, state, ctx):
        if ctx.phase == GROUPING:
            return torch.ones(len(ctx.rows), dtype=torch.bool)
        return state["selected"] & ~state["stopped"]

    # -- local computation -----------------------------------------------------------
    def local_update(self, state, train, ctx):
        if ctx.phase == GROUPING:
            return self._proxy_epoch(state, train, ctx)
        return self._cotrain(state, train, ctx)

    def _proxy_epoch(self, state, train, ctx):
        """Phase 1: one local epoch of (DP) training of the proxy alone."""
        proxy, total, taken = state["proxy"], torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        for _ in range(self.epoch_steps):
            grads, loss, done = self._proxy_gradient(proxy, train, ctx, teacher_params=None)
            proxy = {k: proxy[k] - self.local_lr * grads[k] for k in proxy}
            total, taken = total + loss * done, taken + done
        return {**state, "proxy": proxy, "group_proxy": proxy}, total / taken.clamp_min(1)

    def _cotrain(self, state, train, ctx):
        proxy, private = state["proxy"], state["private"]
        total, taken = torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        stopped = state["stopped"].clone()
        if self.fused != "off" and self.use_proxy and self.teacher != "last-proxy" and type(ctx.model) is LinearSoftmax:
            proxy, private, total, taken = self._fused_step(train, ctx).run(proxy, private, train, ctx, self.config.local_steps)
            stopped |= taken < self.config.local_steps  # the ledger refused a step: budget spent
            return self._cotrained(state, proxy, private, stopped, total, taken)
        stats = input_statistics(ctx.model, train) if ctx.dp is not None else None  # per dataset, cached
        for _ in range(self.config.local_steps):
            index, mask = sample_batches(ctx, train)
            x, y = gather_batch(train.x, index), gather_batch(train.y, index)
            teacher = self._teacher(state, private)
            grads, loss, done = self._proxy_step(proxy, x, y, mask, train, ctx, teacher,
                                                 None if stats is None else gather_batch(stats, index))
            if self.use_proxy:
                # the private model learns on the same batch, without DP, from the proxy's pre-step outputs
                proxy_logits = logits_of(ctx.model, proxy, x)
                _, private_grads = ctx.loss_and_grad(private, x, y, mask.float(), loss=distillation_loss(self.beta), aux=proxy_logits)
                private = {
                    k: private[k] - self.local_lr * private_grads[k] * done.view(-1, *([1] * (private[k].dim() - 1)))
                    for k in private
                }
            proxy = {k: proxy[k] - self.local_lr * grads[k] for k in proxy}
            stopped |= ~done.bool()
            total, taken = total + loss * done, taken + done
        return self._cotrained(state, proxy, private, stopped, total, taken)

    def _teacher(self, state, private):
        """The parameters whose outputs the proxy distils from (None: CE only)."""
        if not self.use_proxy or self.alpha == 0:
            return None
        return state["group_proxy"] if self.teacher == "last-proxy" else private

    def _fused_step(self, train, ctx) -> LinearCotraining:
        """The span path when forced or when it needs fewer FLOPs, else the bucketed one.
        Samples streamed from host memory (`ClientTensors.to(stream=True)`) take the
        bucketed path: the span path reads every sample each round (or a basis as large)."""
        if train.x.device != train.y.device:
            return self._buckets
        if self.fused == "auto":
            samples, dim, c = train.x.shape[1], math.prod(train.x.shape[2:]), self.config
            cheaper = span_is_cheaper(samples, dim, ctx.model.num_classes, c.local_steps, c.data_rate, ctx.dp is not None, self.span_noise)
            return self._span if cheaper and span_fits(train, ctx.dp is not None and self.span_noise == "basis") else self._buckets
        return self._span if self.fused == "span" else self._buckets

    @staticmethod
    def _cotrained(state, proxy, private, stopped, total, taken):
        trained = taken > 0
        return {**state, "proxy": proxy, "private": private, "trained": trained, "stopped": stopped}, total / taken.clamp_min(1)

    def _proxy_gradient(self, proxy, train, ctx, teacher_params):
        index, mask = sample_batches(ctx, train)
        x, y = gather_batch(train.x, index), gather_batch(train.y, index)
        stats = input_statistics(ctx.model, train) if ctx.dp is not None else None
        return self._proxy_step(proxy, x, y, mask, train, ctx, teacher_params, None if stats is None else gather_batch(stats, index))

    def _proxy_step(self, proxy, x, y, mask, train, ctx, teacher_params, stats=None):
        """Gradient of the proxy's loss: DP when the run is private. Returns
        (grads, loss (C,), done (C,) float: 1 where the step was taken). `stats`: the
        batch's `input_statistics` (precomputed per dataset)."""
        loss_fn = distillation_loss(self.alpha if teacher_params is not None else 0.0)
        teacher = logits_of(ctx.model, teacher_params, x) if teacher_params is not None else None
        return batch_gradient(ctx, proxy, x, y, mask, train, loss_fn, teacher, input_stats=stats)

    # -- phase 1 messages ---------------------------------------------------------------
    def outgoing(self, exchange, state, ctx):
        return getattr(self, f"_send_{exchange}")(state, ctx)

    def receive(self, exchange, state, inbox, ctx):
        return getattr(self, f"_receive_{exchange}")(state, inbox, ctx)

    def _send_probe(self, state, ctx):
        """Send the phase-1 proxy to H peers sampled from the client's own stream."""
        count = len(ctx.rows)
        others = torch.full((count,), self.num_clients - 1)
        picks, _ = ctx.rng.subsets(others, torch.full((count,), self.samples), self.samples)
        peers = picks + (picks >= ctx.rows.unsqueeze(1)).long()  # skip oneself
        src = ctx.rows.repeat_interleave(self.samples)
        shared = torch.arange(count).repeat_interleave(self.samples)  # one stored copy per sender
        return Messages(src, peers.reshape(-1), flatten(state["proxy"], UPDATE), shared)

    def _receive_probe(self, state, inbox, ctx):
        """Measure L1 dissimilarity between one's own proxy and each received one."""
        if not len(inbox):  # every sampled peer failed (device runtime)
            return state
        position = torch.searchsorted(ctx.rows, inbox.dst)
        own = vectorize(state["proxy"])
        theirs = vectorize(strip_prefix(inbox.table, UPDATE))
        rows = inbox.table_rows()
        distance = torch.empty(len(inbox))
        chunk = max(1, (1 << 24) // max(own.shape[1], 1))  # bound each temporary to ~64 MB
        for start in range(0, len(inbox), chunk):
            part = slice(start, start + chunk)
            distance[part] = (own[position[part]] - theirs[rows[part]]).abs().sum(dim=1)
        known = state["known"].clone()
        known[position, inbox.src] = distance
        return {**state, "known": known}

    def _send_share(self, state, ctx):
        """Every client shares what it measured with every other client: one broadcast
        (one message per receiver on a real network, one stored message in the simulator)."""
        # the state's own tensor: it is never changed in place (the probe writes a copy)
        return Messages(ctx.rows, torch.full_like(ctx.rows, BROADCAST), {"known": state["known"]})

    def _receive_share(self, state, inbox, ctx):
        rows = ctx.rows.tolist()
        # grouping runs on the host: each row's group, written back to the state in one copy
        assigned = np.zeros((len(rows), self.num_clients), dtype=bool)
        found = np.zeros(len(rows), dtype=bool)
        seen, label = None, np.zeros(0, dtype=np.int64)
        for position, matrix in self._assembled_views(state, inbox, ctx):
            if matrix is not seen:  # usually one matrix for every row: group (and copy to the host) once
                seen, label = matrix, _group_labels(self._groups(matrix), self.num_clients)
            own = label[rows[position]]
            if own >= 0:  # O(M) per row: no search through the groups
                assigned[position] = label == own
                found[position] = True
        members, device = state["members"], state["members"].device
        members = torch.where(torch.from_numpy(found).to(device).unsqueeze(1), torch.from_numpy(assigned).to(device), members)
        return {**state, "members": members}

    def _assembled_views(self, state, inbox, ctx):
        """Yield (row position, dissimilarity matrix) as each client assembles it from
        its own measurements and what it received. When every client received the same
        shares from everyone (the usual case), they all see one matrix: build it once."""
        rows = ctx.rows
        matrix = self._common_view(state, inbox, rows)
        if matrix is not None:
            for position in range(len(rows)):
                yield position, matrix
            return
        if bool(inbox.is_broadcast().any()):  # some clients did not broadcast (or more than once): per receiver
            inbox = inbox.expand_broadcasts(self.num_clients)
            inbox = inbox.select(torch.isin(inbox.dst, rows)).sorted()
        for position, client in enumerate(rows.tolist()):
            mine = inbox.select(inbox.dst == client)
            matrix = torch.full((self.num_clients, self.num_clients), UNKNOWN)
            if len(mine):  # shares of peers that failed stay unknown
                matrix[mine.src] = mine.value("known")
            matrix[client] = state["known"][position]
            yield position, matrix

    def _common_view(self, state, inbox, rows) -> torch.Tensor | None:
        """The one matrix every held row sees when each received every other client's share
        once and all shares agree; else None. A held client's row is its own measurements."""
        wide = inbox.is_broadcast()
        if bool(wide.all()) and len(inbox) == self.num_clients and \
                torch.equal(torch.sort(inbox.src).values, torch.arange(self.num_clients, device=inbox.src.device)):
            if len(rows) == self.num_clients:  # the simulator: every row is held, the state is the matrix
                return state["known"]
            matrix = inbox.value("known")[torch.argsort(inbox.src)]
        else:
            if len(rows) < 2 or bool(wide.any()):
                return None
            received = torch.bincount(torch.searchsorted(rows, inbox.dst), minlength=len(rows)) if len(inbox) else torch.zeros(len(rows))
            if not bool((received == self.num_clients - 1).all()):
                return None
            positions = torch.arange(len(inbox))
            first = torch.full((self.num_clients,), len(inbox), dtype=torch.long).scatter_reduce(0, inbox.src, positions, reduce="amin")
            if not (bool((first < len(inbox)).all()) and _same_as_first(inbox, "known", first)):
                return None
            matrix = inbox.table["known"][inbox.table_rows()[first]]  # O(M^2): the senders' rows, never one per message
        matrix[rows] = state["known"]
        return matrix

    def _groups(self, matrix: torch.Tensor) -> list[list[int]]:
        host = matrix.cpu().numpy()  # grouping is host-side numpy (one read of an M x M matrix)
        return _cached_groups(
            hashlib.sha256(np.ascontiguousarray(host).data).hexdigest(), host, self.group_size,
            self.config.seed, self.grouping,
        )

    # -- phase 2 messages ---------------------------------------------------------------
    def _aggregators(self, state, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(aggregator id (C,), sorted member ids (C, V) padded with -1) for each row.
        The round-robin turn skips members this row saw fail as aggregator (device
        runtime): the next member takes over. Without failures: plain round-robin."""
        sorted_ids = self._sorted_members(state["members"])
        live_ids = sorted_ids
        if bool(state["failed"].any()):
            live_ids = self._sorted_members(state["members"] & ~state["failed"])
        turn = ctx.round % (live_ids >= 0).sum(dim=1).clamp_min(1)
        return live_ids.gather(1, turn.unsqueeze(1)).squeeze(1), sorted_ids

    @staticmethod
    def _sorted_members(members: torch.Tensor) -> torch.Tensor:
        """(C, largest group) each row's member ids in increasing order, padded with -1
        (O(C V) memory: never a (C, M) index table)."""
        rows, ids = members.nonzero(as_tuple=True)  # row-major: each row's ids ascending
        size = torch.bincount(rows, minlength=len(members))
        width = max(int(size.max()) if len(rows) else 0, 1)
        slot = torch.arange(len(rows), device=members.device) - (torch.cumsum(size, 0) - size)[rows]
        table = torch.full((len(members), width), -1, dtype=torch.long, device=members.device)
        table[rows, slot] = ids
        return table

    def _send_announce(self, state, ctx):
        """The round's aggregator samples floor(l * G) members and tells every member."""
        aggregator, sorted_ids = self._aggregators(state, ctx)
        leads = (aggregator == ctx.rows).nonzero().squeeze(1)
        if len(leads) == 0:
            return Messages.empty()
        size = state["members"][leads].sum(dim=1)
        chosen = torch.clamp(torch.floor(self.config.client_rate * size.double()).long(), min=1)
        rng = ctx.rng.take(leads)
        picks, mask = rng.subsets(size, chosen, int(size.max()))
        ctx.rng.put(leads, rng)
        selected = torch.zeros(len(leads), int(size.max()), dtype=torch.bool)
        selected.scatter_(1, picks, mask)
        dst = sorted_ids[leads, : int(size.max())]
        real = dst >= 0
        src = ctx.rows[leads].unsqueeze(1).expand_as(dst)
        payload = {"selected": selected[real]}
        if ctx.round == 0:  # the group's starting proxy: the aggregator's (a DP release)
            lead_of_message = torch.arange(len(leads)).unsqueeze(1).expand_as(dst)[real]
            payload.update(flatten({k: v[leads][lead_of_message] for k, v in state["group_proxy"].items()}, MODEL))
        return Messages(src[real], dst[real], payload)

    def _receive_announce(self, state, inbox, ctx):
        position = torch.searchsorted(ctx.rows, inbox.dst)
        selected = torch.zeros(len(ctx.rows), dtype=torch.bool)
        lead = torch.full((len(ctx.rows),), -1, dtype=torch.long)
        if len(inbox):  # after a fault two aggregators may announce: follow the lowest id
            first = torch.cat([torch.ones(1, dtype=torch.bool), position[1:] != position[:-1]])
            selected[position[first]] = inbox.payload["selected"][first].bool()
            lead[position[first]] = inbox.src[first]
            if any(k.startswith(MODEL) for k in inbox.payload):
                state = self._start_from(state, position[first], strip_prefix(inbox.select(first).payload, MODEL))
        trained = torch.zeros(len(ctx.rows), dtype=torch.bool)
        failed, missing = state["failed"], (lead < 0).nonzero().squeeze(1)
        if len(missing) or bool(failed.any()):
            # Device runtime: a row that heard no announce saw this round's aggregator
            # fail and skips its turns from now on, until it announces again (rejoin).
            expected, _ = self._aggregators(state, ctx)
            failed = failed.clone()
            failed[position, inbox.src] = False
            missing = missing[expected[missing] >= 0]
            failed[missing, expected[missing]] = True
        return {**state, "selected": selected, "trained": trained, "lead": lead, "failed": failed}

    @staticmethod
    def _start_from(state, position, model):
        """Rows `position` set proxy and group proxy to the received group model."""
        proxy = {k: v.clone() for k, v in state["proxy"].items()}
        for k in proxy:
            proxy[k][position] = model[k].to(proxy[k].dtype)
        return {**state, "proxy": proxy, "group_proxy": {k: v.clone() for k, v in proxy.items()}}

    def _send_upload(self, state, ctx):
        """Participants send their proxy delta to the round's aggregator (the one that announced)."""
        senders = state["trained"] & (state["lead"] >= 0)
        if bool(senders.all()):  # the usual case: one pass, no row copies
            delta = {k: state["proxy"][k] - state["group_proxy"][k] for k in state["proxy"]}
        else:
            delta = {k: state["proxy"][k][senders] - state["group_proxy"][k][senders] for k in state["proxy"]}
        # no weight travels: the aggregator weights its group's members equally (the paper's
        # group average), so nothing a sender declares changes its share of the mean
        return Messages(ctx.rows[senders], state["lead"][senders], flatten(delta, UPDATE))

    def _receive_upload(self, state, inbox, ctx):
        """Aggregators filter (defense), average and apply eta_g to their group's proxy."""
        if not len(inbox):
            return state
        dst, mean = ctx.aggregator.aggregate_by_destination(inbox, torch.ones(len(inbox), dtype=torch.float64), ctx.round)
        position = torch.searchsorted(ctx.rows, dst)
        base = {k: v[position] for k, v in state["group_proxy"].items()}
        step = unvectorize(mean.to(torch.float32), base)
        group_proxy = {k: v.clone() for k, v in state["group_proxy"].items()}
        for k in group_proxy:
            group_proxy[k][position] = base[k] + self.config.global_lr * step[k]
        return {**state, "group_proxy": group_proxy}

    def _send_distribute(self, state, ctx):
        """Aggregators (rows that announced this round) send the new group proxy to every
        member (themselves included)."""
        _, sorted_ids = self._aggregators(state, ctx)
        leads = (state["lead"] == ctx.rows).nonzero().squeeze(1)
        if len(leads) == 0:
            return Messages.empty()
        dst = sorted_ids[leads]
        real = dst >= 0
        counts = real.sum(dim=1)
        model = {k: v[leads] for k, v in state["group_proxy"].items()}
        src = ctx.rows[leads].repeat_interleave(counts)
        return Messages(src, dst[real], flatten(model, MODEL), torch.arange(len(leads)).repeat_interleave(counts))

    def _receive_distribute(self, state, inbox, ctx):
        position = torch.searchsorted(ctx.rows, inbox.dst)
        # Only the followed aggregator's model counts. Rows that got none (their aggregator
        # failed: device runtime) fall back to the last group proxy, losing the round's update.
        keep = inbox.src == state["lead"][position]
        if not bool(keep.all()):
            inbox, position = inbox.select(keep), position[keep]
        got = torch.zeros(len(ctx.rows), dtype=torch.bool)
        got[position] = True
        proxy = {k: torch.where(got.view(-1, *[1] * (v.dim() - 1)), v, state["group_proxy"][k]) for k, v in state["proxy"].items()}
        if len(inbox):
            model = strip_prefix(inbox.payload, MODEL)
            for k in proxy:
                proxy[k][position] = model[k]
        return {**state, "proxy": proxy, "group_proxy": {k: v.clone() for k, v in proxy.items()}}

    def update_reference(self, exchange, state):
        return state["group_proxy"] if exchange == "upload" else None

    def working_bytes(self, num_clients):
        """The grouping's M x M matrices (GROUPING_BYTES_PER_PAIR per pair of clients); its
        share exchange is one broadcast per client, not one message per pair."""
        return num_clients * num_clients * GROUPING_BYTES_PER_PAIR

    def payload_bounds(self, exchange, phase, round_index):
        """Shared distances are L1 distances (>= 0), or -1 where unknown."""
        return {"known": (UNKNOWN, float("inf"))} if exchange == "share" else {}

    def message_layout(self, exchange, phase, round_index):
        """Declared, since members receive `distribute` (and `announce`) without sending in it."""
        proxy = self.initial_params()
        layouts = {
            "probe": lambda: params_layout(proxy, UPDATE),
            "share": lambda: {"known": (torch.float32, (self.num_clients,))},
            "announce": lambda: {"selected": (torch.bool, ()), **(params_layout(proxy, MODEL) if round_index == 0 else {})},
            "upload": lambda: params_layout(proxy, UPDATE),
            "distribute": lambda: params_layout(proxy, MODEL),
        }
        return layouts[exchange]() if exchange in layouts else None

    # -- reporting ------------------------------------------------------------------------
    def groups_of(self, state) -> list[list[int]]:
        """Distinct groups as seen by the clients (for artifacts and tests)."""
        seen = {tuple(row.nonzero().squeeze(1).tolist()) for row in state["members"]}
        return sorted(list(g) for g in seen if g)

    def write_artifacts(self, state, folder):
        """groups.json (groups, sizes and, up to ARTIFACT_MATRIX_CLIENTS clients, the
        collaboration matrix) and, up to that size, dissimilarity.png (the sampled L1
        dissimilarities, clients ordered by group): an M x M matrix as JSON or pixels is
        GBs at the paper's 2,080 clients and beyond, and the groups say the same."""
        groups = self.groups_of(state)
        small = self.num_clients <= ARTIFACT_MATRIX_CLIENTS
        record = {"grouping": self.grouping, "target_size": self.group_size, "groups": groups,
                  "sizes": [len(g) for g in groups]}
        if small:
            record["collaboration_matrix"] = collaboration_matrix(groups, self.num_clients).tolist()
        (folder / "groups.json").write_text(json.dumps(record))
        if not small:
            return [folder / "groups.json"]
        dissimilarity = symmetric(state["known"].cpu().numpy())
        order = [c for g in groups for c in g]
        _plot_dissimilarity(dissimilarity[np.ix_(order, order)], [len(g) for g in groups], folder / "dissimilarity.png")
        return [folder / "groups.json", folder / "dissimilarity.png"]


def _plot_dissimilarity(values: np.ndarray, sizes: list[int], path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    figure = Figure(figsize=(6, 5))
    axes = figure.add_subplot()
    shown = np.where(np.isfinite(values), values, np.nan)
    image = axes.imshow(shown, interpolation="nearest", cmap="viridis_r")
    figure.colorbar(image, ax=axes, label="L1 dissimilarity of phase-1 proxies (blank: not sampled)")
    edge = -0.5
    for size in sizes:  # outline each group on the diagonal
        axes.add_patch(Rectangle((edge, edge), size, size, fill=False, edgecolor="red", linewidth=1))
        edge += size
    axes.set_xlabel("client (ordered by group)")
    axes.set_ylabel("client (ordered by group)")
    axes.set_title("P4 phase 1: sampled dissimilarities and groups")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


@lru_cache(maxsize=64)
def _group_cache(digest: str, group_size: int, seed: int, mode: str) -> tuple[tuple[int, ...], ...]:
    matrix = _PENDING.pop(digest)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PUBLIC_SEED]))
    count = len(matrix)
    groups = form_groups(matrix, group_size, rng) if mode == "similarity" else random_groups(count, group_size, rng)
    return tuple(tuple(g) for g in groups)


_PENDING: dict[str, np.ndarray] = {}


def _cached_groups(digest: str, matrix: np.ndarray, group_size: int, seed: int, mode: str) -> list[list[int]]:
    """Grouping is a pure function of its inputs; identical inputs are computed once."""
    _PENDING[digest] = matrix
    try:
        return [list(g) for g in _group_cache(digest, group_size, seed, mode)]
    finally:
        _PENDING.pop(digest, None)
