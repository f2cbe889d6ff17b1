"""P4's phase-2 messages (Algorithm 2), as a mixin of `P4`: per group and round, the
round's aggregator (round-robin over the sorted members, skipping members seen to fail)
announces the sampled members (`announce`; in the first round with its proxy, which every
member starts from), the members that trained send their proxy deltas (`upload`), the
aggregator filters them with the run's defense, averages them and applies eta_g, and
sends the new group proxy to every member (`distribute`). How far members trust that
aggregator (option `aggregator_check`: the turn, a recomputed aggregate, or wholesale as
in the paper) is in `p4bench_p4.aggregator_check`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Messages
from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX
from p4bench.engine.state import State, flatten, strip_prefix, unvectorize, vectorize
from p4bench.models import Params
from p4bench_p4.aggregator_check import (
    AGGREGATE_MISMATCH,
    NON_MEMBER_UPLOAD,
    OUT_OF_TURN_ANNOUNCE,
    OUT_OF_TURN_DISTRIBUTE,
    group_members_of,
    in_turn,
    matches_aggregate,
    scheduled_turn,
)
from p4bench_p4.chunked_exchange import aggregate_in_chunks, receiver_chunks

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.method import StepContext

__all__ = ["CHECKED", "REJECTED", "CotrainingExchanges"]

UPDATE, MODEL = UPDATE_PREFIX, MODEL_PREFIX
# round-metric counters (summed over members and rounds; the run's `method_figures`):
# distributed models a member compared with its own aggregate, and those it rejected
CHECKED, REJECTED = "p4.distributed_models_checked", "p4.distributed_models_rejected"


def count(ctx: StepContext, name: str, n: int) -> None:
    ctx.metrics[name] = ctx.metrics.get(name, 0.0) + n


class CotrainingExchanges:
    """The `announce`, `upload` and `distribute` exchanges of P4's co-training phase. Uses
    the method's `config` (client_rate, global_lr) and its `aggregator_check` options."""

    config: RunConfig
    aggregator_check: str  # recompute | turn | none (p4bench_p4.aggregator_check)
    aggregator_tolerance: float

    def _aggregators(self, state: State, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _send_announce(self, state: State, ctx: StepContext) -> Messages:
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
            payload.update(
                flatten(
                    {k: v[leads][lead_of_message] for k, v in state["group_proxy"].items()}, MODEL
                )
            )
        return Messages(src[real], dst[real], payload)

    def _receive_announce(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        position = torch.searchsorted(ctx.rows, inbox.dst)
        if self.aggregator_check != "none" and len(inbox):
            inbox, position = self._announcers_in_turn(state, inbox, position, ctx)
        selected = torch.zeros(len(ctx.rows), dtype=torch.bool)
        lead = torch.full((len(ctx.rows),), -1, dtype=torch.long)
        if len(inbox):  # after a fault two aggregators may announce: follow the lowest id
            first = torch.cat([torch.ones(1, dtype=torch.bool), position[1:] != position[:-1]])
            selected[position[first]] = inbox.payload["selected"][first].bool()
            lead[position[first]] = inbox.src[first]
            if any(k.startswith(MODEL) for k in inbox.payload):
                state = self._start_from(
                    state, position[first], strip_prefix(inbox.select(first).payload, MODEL)
                )
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

    def _announcers_in_turn(
        self, state: State, inbox: Messages, position: torch.Tensor, ctx: StepContext
    ) -> tuple[Messages, torch.Tensor]:
        """The announcements whose sender's turn it is (the row's expected aggregator
        first); the others are rejected and their senders named."""
        expected, sorted_ids = self._aggregators(state, ctx)
        order, out_of_turn = in_turn(
            inbox, position, expected, scheduled_turn(sorted_ids, ctx.round)
        )
        ctx.reject(OUT_OF_TURN_ANNOUNCE, inbox.src[out_of_turn])
        return inbox.select(order), position[order]

    @staticmethod
    def _start_from(state: State, position: torch.Tensor, model: Params) -> State:
        """Rows `position` set proxy and group proxy to the received group model."""
        proxy = {k: v.clone() for k, v in state["proxy"].items()}
        for k in proxy:
            proxy[k][position] = model[k].to(proxy[k].dtype)
        return {**state, "proxy": proxy, "group_proxy": {k: v.clone() for k, v in proxy.items()}}

    def _send_upload(self, state: State, ctx: StepContext) -> Messages:
        """Participants send their proxy delta to the round's aggregator (the one that
        announced); with aggregator_check=recompute to every member of their group, so
        that each can recompute the aggregate."""
        senders = state["trained"] & (state["lead"] >= 0)
        if bool(senders.all()):  # the usual case: one pass, no row copies
            delta = {k: state["proxy"][k] - state["group_proxy"][k] for k in state["proxy"]}
        else:
            delta = {
                k: state["proxy"][k][senders] - state["group_proxy"][k][senders]
                for k in state["proxy"]
            }
        # no weight travels: the aggregator weights its group's members equally (the paper's
        # group average), so nothing a sender declares changes its share of the mean
        if self.aggregator_check != "recompute":
            return Messages(ctx.rows[senders], state["lead"][senders], flatten(delta, UPDATE))
        # the same release to every member: stored once per sender (`rows`), never copied
        _, sorted_ids = self._aggregators(state, ctx)
        dst = sorted_ids[senders]
        real = dst >= 0
        counts = real.sum(dim=1)
        src = ctx.rows[senders].repeat_interleave(counts)
        table = torch.arange(len(dst)).repeat_interleave(counts)
        return Messages(src, dst[real], flatten(delta, UPDATE), table)

    def _receive_upload(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        """Aggregators filter (defense), average and apply eta_g to their group's proxy;
        with aggregator_check=recompute every member does, from the uploads it got."""
        if len(inbox) and self.aggregator_check != "none":
            member = group_members_of(state, inbox.src, torch.searchsorted(ctx.rows, inbox.dst))
            if not bool(member.all()):  # an upload is a group's business only
                ctx.reject(NON_MEMBER_UPLOAD, inbox.src[~member])
                inbox = inbox.select(member)
        if not len(inbox):
            return state
        dst, mean = aggregate_in_chunks(ctx.aggregator, inbox, ctx.round)
        position = torch.searchsorted(ctx.rows, dst)
        # in place on copies of the rows' group proxies: no gathered base and no summed
        # temporary beside them (the same two roundings, lr * step then the sum)
        step = unvectorize(mean.to(torch.float32).mul_(self.config.global_lr), state["group_proxy"])
        group_proxy = {k: v.clone() for k, v in state["group_proxy"].items()}
        for k in group_proxy:
            group_proxy[k].index_add_(0, position, step[k])
        return {**state, "group_proxy": group_proxy}

    def _send_distribute(self, state: State, ctx: StepContext) -> Messages:
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
        return Messages(
            src,
            dst[real],
            flatten(model, MODEL),
            torch.arange(len(leads)).repeat_interleave(counts),
        )

    def _receive_distribute(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        position = torch.searchsorted(ctx.rows, inbox.dst)
        # Only the followed aggregator's model counts. Rows that got none (their aggregator
        # failed: device runtime) fall back to the last group proxy, losing the round's
        # update (with aggregator_check=recompute: to their own aggregate of the round).
        keep = inbox.src == state["lead"][position]
        if not bool(keep.all()):
            if self.aggregator_check != "none":
                self._name_out_of_turn(state, inbox.select(~keep), position[~keep], ctx)
            inbox, position = inbox.select(keep), position[keep]
        if self.aggregator_check == "recompute" and len(inbox):
            checked = len(inbox)
            inbox, position = self._matching_aggregate(state, inbox, position, ctx)
            count(ctx, CHECKED, checked)
            count(ctx, REJECTED, checked - len(inbox))
        got = torch.zeros(len(ctx.rows), dtype=torch.bool)
        got[position] = True
        proxy = {
            k: torch.where(got.view(-1, *[1] * (v.dim() - 1)), v, state["group_proxy"][k])
            for k, v in state["proxy"].items()
        }
        if len(inbox):
            model = strip_prefix(inbox.payload, MODEL)
            for k in proxy:
                proxy[k][position] = model[k]
        return {**state, "proxy": proxy, "group_proxy": {k: v.clone() for k, v in proxy.items()}}

    def _name_out_of_turn(
        self, state: State, inbox: Messages, position: torch.Tensor, ctx: StepContext
    ) -> None:
        """Names the senders of a `distribute` that are neither the followed aggregator
        nor a scheduled one (after a fault a takeover aggregator may still send: not named)."""
        expected, sorted_ids = self._aggregators(state, ctx)
        scheduled = scheduled_turn(sorted_ids, ctx.round)
        legit = (inbox.src == expected[position]) | (inbox.src == scheduled[position])
        ctx.reject(OUT_OF_TURN_DISTRIBUTE, inbox.src[~legit])

    def _matching_aggregate(
        self, state: State, inbox: Messages, position: torch.Tensor, ctx: StepContext
    ) -> tuple[Messages, torch.Tensor]:
        """The distributed models equal to the receiving member's own aggregate of the
        round (its group proxy after `upload`); the others are rejected, the aggregator
        named, and the member keeps its own aggregate (the fallback of a row that got none)."""
        # in chunks of receivers: the gathered models and their float64 gaps stay bounded
        same = torch.cat(
            [
                matches_aggregate(
                    vectorize(strip_prefix(inbox.select(chunk).payload, MODEL)),
                    vectorize({k: v[position[chunk]] for k, v in state["group_proxy"].items()}),
                    self.aggregator_tolerance,
                )
                for chunk in receiver_chunks(inbox)
            ]
        )
        if bool(same.all()):
            return inbox, position
        ctx.reject(AGGREGATE_MISMATCH, inbox.src[~same])
        return inbox.select(same), position[same]
