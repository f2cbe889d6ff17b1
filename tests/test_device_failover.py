"""P4 on a lossy network (in-process): a member whose messages stop arriving is dropped
from its group's rounds, the next member takes over its aggregator turns, and the
simulator's fault-free runs never take these paths."""

from __future__ import annotations

import numpy as np
import torch

from p4bench.engine.network import BytesNetwork, Delivery
from p4bench.engine.runtime import BytesRuntime
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.run.runner import prepare

CUT, FROM_ROUND = 2, 1  # client 2 is cut off from co-training round 1 on


class CutOffNetwork(BytesNetwork):
    """Byte frames; from `FROM_ROUND` of co-training on, every message from or to client
    `CUT` is lost (as if its device disappeared)."""

    def exchange(self, exchange, phase, round_index, outgoing):
        delivery = super().exchange(exchange, phase, round_index, outgoing)
        if exchange in ("announce", "upload", "distribute") and round_index >= FROM_ROUND:
            inbox = delivery.inbox
            keep = ((inbox.src != CUT) & (inbox.dst != CUT)) | (inbox.src == inbox.dst)
            return Delivery(inbox.select(keep), delivery.inbox_sizes[keep], delivery.sent_sizes)
        return delivery


class CutOffRuntime(BytesRuntime):
    """One node per client with byte frames over the cut-off network."""

    name = "cut-off-test"

    def network(self):
        return CutOffNetwork()


def _snapshot(runtime):
    return {
        int(g.rows[0]): {
            k: (v.clone() if torch.is_tensor(v) else {n: t.clone() for n, t in v.items()})
            for k, v in g.state.items()
        }
        for g in runtime.driver.groups
    }


def test_next_member_takes_over_a_lost_aggregator(small_config):
    config = small_config(
        method="p4",
        clients=4,
        rounds=7,
        local_steps=1,
        eval_fraction=0.0,
        options={"group_size": 4},
    )
    prepared = prepare(config, Registry(create_plugin_manager()))
    runtime = CutOffRuntime()
    states = {}

    def on_round(report):
        states[(report.phase, report.round)] = _snapshot(runtime)

    outcome = runtime.execute(prepared.job, on_round)
    live = [0, 1, 3]
    assert np.isfinite(outcome.accuracy).all()
    # round 1: client 1 aggregates as usual (client 2's upload is lost)
    assert all(int(states[("cotraining", 1)][c]["lead"][0]) == 1 for c in live)
    # round 2 is client 2's turn: nobody hears an announce, nobody trains, the group
    # proxy stays, and every live member marks client 2 as failed
    before, during = states[("cotraining", 1)], states[("cotraining", 2)]
    for c in live:
        assert int(during[c]["lead"][0]) == -1 and not bool(during[c]["trained"][0])
        assert bool(during[c]["failed"][0, CUT]) and int(during[c]["failed"][0].sum()) == 1
        for k, v in during[c]["group_proxy"].items():
            assert torch.equal(v, before[c]["group_proxy"][k])
    # from round 3 the rotation runs over the live members [0, 1, 3]: 3 % 3 -> client 0
    after = states[("cotraining", 3)]
    assert all(int(after[c]["lead"][0]) == 0 for c in live)
    models = [torch.cat([t.flatten() for t in after[c]["group_proxy"].values()]) for c in live]
    assert all(torch.equal(models[0], m) for m in models[1:])  # one distributed group proxy
    assert not torch.equal(
        models[0], torch.cat([t.flatten() for t in during[0]["group_proxy"].values()])
    )
    # every later round has a live aggregator: the group keeps training
    for r in range(3, 7):
        leads = {int(states[("cotraining", r)][c]["lead"][0]) for c in live}
        assert len(leads) == 1 and leads <= set(live)


def test_fault_free_runs_never_mark_failures(small_config):
    from p4bench.run.runner import run

    result = run(
        small_config(method="p4", clients=6, rounds=3, local_steps=1, options={"group_size": 3}),
        track=False,
    )
    state = result.outcome.final_state
    assert not bool(state["failed"].any())
    assert bool((state["lead"] >= 0).all())  # every client followed an announcing aggregator
    # the followed aggregator is a member of the client's group
    assert bool(state["members"][torch.arange(6), state["lead"]].all())
