"""`aggregator-poison` inside a compromised device peer (4 peer processes on 127.0.0.1):
each member checks what it alone received, names the aggregator and keeps its own
aggregate, so the honest members' proxies end as in the clean simulated run."""

from __future__ import annotations

import numpy as np

from p4bench.config import RunConfig
from p4bench.run.runner import run
from p4bench_p4.aggregator_check import AGGREGATE_MISMATCH

PEERS, ROUNDS = 4, 4  # one group of 4: every member holds the aggregator turn once
FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}


def test_a_poisoning_device_peer_is_named_and_the_honest_proxies_stay_clean(results_dir):
    common = dict(
        method="p4",
        clients=PEERS,
        rounds=ROUNDS,
        local_steps=2,
        eval_fraction=0.0,
        results_dir=results_dir,
    )
    clean = run(RunConfig(**common, options={"group_size": PEERS}), track=False)
    attacked = run(
        RunConfig(
            **common,
            attack="aggregator-poison",
            malicious_fraction=0.25,
            runtime="device",
            noise_source="seeded",  # the simulator's numbers: a run marked as a simulation
            device_simulation=True,
            options={"group_size": PEERS, "device_local_peers": PEERS, **FAST},
        ),
        track=False,
    )
    malicious = np.flatnonzero(attacked.info.malicious).tolist()
    honest = attacked.info.reported
    assert len(malicious) == 1 and honest.sum() == PEERS - 1
    named = {k for k, v in attacked.summary["rejections"].items() if v}
    assert named == {f"{AGGREGATE_MISMATCH} from {malicious[0]}"}
    proxy = {
        name: np.asarray(result.outcome.extra_accuracy["proxy"])[honest]
        for name, result in (("clean", clean), ("attacked", attacked))
    }
    assert abs(proxy["attacked"].mean() - proxy["clean"].mean()) <= 0.02
