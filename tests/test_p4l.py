"""P4L (method `p4l`): the synergy protocol on real Paillier keys and Ed25519 signatures,
churn and crashes, accept-if-better, defense compatibility, the mrt/mrr stop, the
participation metrics and the device runtime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p4bench.errors import ConfigError, IncompatibleError
from p4bench.run.runner import run
from p4bench_p4l.chain_crypto import ChainCrypto
from p4bench_p4l.peer import FINAL_PREFIX, Peer
from p4bench_p4l.plan import PlanSettings, SynergyPlan, law_weights, round_plan

SMALL_KEYS = {"key_bits": 512}  # real Paillier, small modulus: test speed only
FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}


def _config(small_config, **changes):
    options = {**SMALL_KEYS, **changes.pop("options", {})}
    return small_config(
        **{"method": "p4l", "clients": 8, "rounds": 3, "options": options, **changes}
    )


# -- the protocol between real peers ---------------------------------------------------------------
def _peers(count: int, crypto: ChainCrypto, size: int) -> list[Peer]:
    settings = PlanSettings(
        seed=0,
        num_peers=count,
        synergies=1,
        size=size,
        size_min=3,
        size_max=10,
        size_law="fixed",
        peer_law="uniform",
        retries=1,
        drop_prob=0.0,
        crash_prob=0.0,
        global_timeout=None,
    )
    peers = [Peer(i, crypto, settings, size) for i in range(count)]
    for peer in peers:
        peer.directory = {p.node: p.signing.public_bytes for p in peers}
    return peers


def _chain(peers: list[Peer], vectors: torch.Tensor, size: int):
    """Run one synergy initiated by peer 0 through `size` members; (final token, members)."""
    plan = SynergyPlan(7, 0, size, False, size + 1)
    for peer, vector in zip(peers, vectors):
        peer.new_round([plan], vector)
    reachable = np.ones(len(peers), dtype=bool)
    holder, tick = 0, 0
    while True:
        ((target, token),) = peers[holder].hop_outgoing(tick, reachable)
        peers[target].hop_receive(tick, holder, token)
        beacons = peers[target].ack_outgoing()
        peers[holder].ack_receive([(target, s, h) for _, s, h in beacons])
        if target == 0:
            return peers[0].initiated[7].final
        holder, tick = target, tick + 1


@pytest.mark.parametrize("size", [3, 6, 10])
def test_chain_sum_of_packed_vectors_decrypts_exactly_and_members_verify_it(size):
    crypto = ChainCrypto(
        "paillier", 512, 157
    )  # 157 values: not a multiple of the slots per ciphertext
    peers = _peers(size, crypto, size)
    vectors = torch.randn(size, 157, dtype=torch.float64) * 3  # negatives included
    final = _chain(peers, vectors, size)
    assert final is not None and sorted(int(m) for m in final["members"]) == list(range(size))
    ((members, aggregate),) = peers[0].aggregates()
    fixed = torch.round(vectors * 1e10).sum(0) / 1e10  # the exact fixed-point sum
    for member in members[1:]:
        average = peers[member].open_aggregate(0, aggregate)
        assert average is not None
        torch.testing.assert_close(average * size, fixed, atol=1e-9, rtol=0)


def test_a_tampered_hop_and_a_wrong_decryption_proof_are_rejected():
    crypto = ChainCrypto("paillier", 512, 20)
    peers = _peers(3, crypto, 3)
    vectors = torch.randn(3, 20, dtype=torch.float64)
    plan = SynergyPlan(7, 0, 3, False, 4)
    for peer, vector in zip(peers, vectors):
        peer.new_round([plan], vector)
    ((target, token),) = peers[0].hop_outgoing(0, np.ones(3, dtype=bool))
    tampered = {**token, "slots": token["slots"] + 1}  # one field changed after signing
    peers[target].hop_receive(0, 0, tampered)
    assert peers[target].stats["bad_signatures"] == 1 and not peers[target].outbox
    forged = {
        **token,
        "vk": torch.frombuffer(bytearray(peers[2].signing.public_bytes), dtype=torch.uint8),
    }
    peers[target].hop_receive(0, 0, forged)  # someone else's key: not the one peer 0 announced
    assert peers[target].stats["bad_signatures"] == 2
    peers[target].hop_receive(0, 0, token)  # the genuine token is taken
    assert len(peers[target].outbox) == 1

    peers = _peers(3, crypto, 3)
    _chain(peers, vectors, 3)
    ((members, aggregate),) = peers[0].aggregates()
    plain = aggregate["plain"].clone()
    plain[0, -1] ^= 1  # a wrong decryption, re-signed by the initiator: only the proof catches it
    wrong = peers[0]._sign({k: v for k, v in aggregate.items() if k != "sig"} | {"plain": plain})
    assert peers[1].open_aggregate(0, wrong) is None and peers[1].stats["bad_proofs"] == 1
    swapped = dict(aggregate)
    swapped[FINAL_PREFIX + "slots"] = (
        aggregate[FINAL_PREFIX + "slots"] + 1
    )  # the final token altered
    assert peers[2].open_aggregate(0, swapped) is None and peers[2].stats["bad_signatures"] == 1
    assert peers[2].open_aggregate(0, aggregate) is not None


def test_plan_draws_are_public_and_follow_the_laws():
    settings = PlanSettings(
        seed=3,
        num_peers=20,
        synergies=4,
        size=5,
        size_min=3,
        size_max=10,
        size_law="powerlaw",
        peer_law="powerlaw",
        retries=2,
        drop_prob=0.0,
        crash_prob=0.0,
        global_timeout=None,
    )
    assert round_plan(settings, 2) == round_plan(settings, 2)  # every process draws the same
    plans = [p for r in range(300) for p in round_plan(settings, r)]
    assert len({p.initiator for p in round_plan(settings, 5)}) == 4  # distinct initiators
    sizes = np.array([p.size for p in plans])
    assert (
        sizes.min() >= 3 and sizes.max() <= 10 and sizes.mean() > 6.5
    )  # a = 2 favours large synergies
    weights = law_weights("powerlaw", 20)
    assert weights.sum() == pytest.approx(1.0) and weights[-1] > weights[0]
    high = np.mean([p.initiator >= 10 for p in plans])
    assert high > 0.6


# -- runs ----------------------------------------------------------------------------------------------
def test_paillier_and_plaintext_runs_agree(small_config):
    paillier = run(_config(small_config, options={"crypto": "paillier"}), track=False)
    plain = run(_config(small_config, options={"crypto": "plaintext"}), track=False)
    assert abs(paillier.summary["accuracy_mean"] - plain.summary["accuracy_mean"]) <= 0.01
    for result in (paillier, plain):
        s = result.summary
        assert s["epsilon"] is None and s["dp"] == "none" and s["p4l.completion_rate"] == 1.0
        assert s["p4l.bytes_per_hop"] > 0 and s["p4l.crypto_s_per_hop"] > 0
        assert 0.5 <= s["test_auc_mean"] <= 1.0 and s["test_loss_mean"] > 0
    assert (
        paillier.summary["secure_aggregation"] == "paillier-512"
        and paillier.summary["min_group"] == 4
    )
    assert (
        paillier.summary["p4l.bytes_per_hop"] > 2 * plain.summary["p4l.bytes_per_hop"]
    )  # ciphertexts are larger


def test_churn_reports_completion_and_retries_and_a_crashed_initiator_aborts(
    small_config, tmp_path
):
    churn = run(
        _config(
            small_config,
            rounds=4,
            options={"crypto": "plaintext", "drop_prob": 0.2, "synergies": 3},
        ),
        track=False,
    )
    s = churn.summary
    assert s["rounds_completed"] == 4 and s["p4l.retries_per_synergy"] > 0
    assert 0 < s["p4l.completion_rate"] <= 1
    assert sum(r.metrics["p4l.dropped_hops"] for r in churn.outcome.reports) > 0
    assert sum(r.metrics["p4l.retries"] for r in churn.outcome.reports) > 0

    crashed = run(
        _config(small_config, options={"crypto": "plaintext", "crash_prob": 1.0}), track=False
    )
    s = crashed.summary
    assert s["p4l.completion_rate"] == 0.0 and s["p4l.wasted_fraction"] == pytest.approx(1.0)
    assert s["count_synergies_mean"] == 0.0  # nobody got an aggregate: models only trained locally
    rows = (
        (crashed.write_method_artifacts(tmp_path) or [tmp_path / "none"])[0]
        .read_text()
        .splitlines()
    )
    assert rows[0].startswith("round,synergy,initiator") and all(
        ",crashed," in line for line in rows[1:]
    )


def test_defenses_that_need_individual_updates_are_refused_and_accept_if_better_runs(small_config):
    with pytest.raises(IncompatibleError, match="only ever exposes running sums"):
        run(_config(small_config, defense="m-krum"), track=False)
    with pytest.raises(ConfigError, match="no differential privacy"):
        run(_config(small_config, epsilon=4.0), track=False)
    result = run(
        _config(small_config, defense="accept-if-better", options={"crypto": "plaintext"}),
        track=False,
    )
    assert result.summary["p4l.completion_rate"] == 1.0


def test_mrt_mrr_stops_the_run(small_config):
    result = run(
        _config(small_config, rounds=30, options={"crypto": "plaintext", "mrt": 2, "mrr": 0.5}),
        track=False,
    )
    counts = result.outcome.reports[-1].extra_accuracy["count_synergies"]
    assert result.summary["stopped_by_method"] and result.summary["rounds_completed"] < 30
    assert np.mean(counts >= 2) >= 0.5


def test_metrics_by_participation_count_follow_each_peers_rth_synergy():
    from p4bench.records import RoundReport
    from p4bench.tracking.participation import participation_curve

    def report(accuracy, counts):
        return RoundReport(
            "train",
            0,
            1,
            np.array(accuracy),
            0.0,
            0.0,
            0,
            extra_accuracy={
                "count_synergies": np.array(counts, dtype=float),
                "test_auc": np.array(accuracy) / 2,
            },
        )

    # peer 0 joins in rounds 0 and 2, peer 1 twice in round 1, peer 2 never; peer 3 is not reported
    reports = [
        report([0.1, 0.2, 0.3, 0.9], [1, 0, 0, 5]),
        report([0.4, 0.5, 0.6, 0.9], [1, 2, 0, 5]),
        report([0.7, 0.8, 0.9, 0.9], [2, 2, 0, 5]),
    ]
    rows = participation_curve(reports, np.array([True, True, True, False]))
    assert [row["r"] for row in rows] == [1.0, 2.0]
    assert rows[0]["peers"] == 2 and rows[0]["accuracy"] == pytest.approx((0.1 + 0.5) / 2)
    assert rows[1]["peers"] == 2 and rows[1]["accuracy"] == pytest.approx((0.7 + 0.5) / 2)
    assert rows[1]["auc"] == pytest.approx(0.3) and np.isnan(rows[0]["loss"])


def test_tracked_run_writes_the_participation_curve_and_logs_it_by_r(small_config):
    result = run(_config(small_config, rounds=4, options={"crypto": "plaintext"}))
    folder = result.summary["results_dir"]
    import csv
    from pathlib import Path

    rows = list(csv.DictReader(open(Path(folder) / "participation_curve.csv")))
    assert (
        rows
        and rows[0]["r"] == "1"
        and (Path(folder) / "participation_curve.png").stat().st_size > 1000
    )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.summary["tracking_uri"])
    history = client.get_metric_history(result.summary["run_id"], "by_participation.accuracy")
    assert sorted(m.step for m in history) == [int(r["r"]) for r in rows]


def test_accept_if_better_gates_every_method_on_the_clients_own_records(small_config):
    """The generic gate: a receive that makes a client's model worse on its own records is undone."""
    base = dict(attack="byzantine-random", malicious_fraction=0.5, rounds=3)
    gated = run(small_config(method="fedavg", defense="accept-if-better", **base), track=False)
    plain = run(small_config(method="fedavg", **base), track=False)
    assert gated.summary["gate.judged"] > 0 and gated.summary["gate.rejected"] > 0
    assert "gate.judged" not in plain.summary
    assert gated.summary["accuracy_mean"] > plain.summary["accuracy_mean"]


def test_p4l_runs_over_tls_on_device_peers_like_the_simulator(small_config):
    options = {"crypto": "paillier", "key_bits": 1024, "drop_prob": 0.2}
    config = small_config(
        method="p4l",
        clients=4,
        rounds=2,
        noise_source="seeded",
        device_simulation=True,
        options=options,
    )
    simulated = run(config, track=False)
    device = run(
        config.replace(runtime="device", options={**options, "device_local_peers": 4, **FAST}),
        track=False,
    )
    assert not device.summary.get("device", {}).get("dropped")
    np.testing.assert_allclose(device.outcome.accuracy, simulated.outcome.accuracy, atol=1e-4)
    for key in ("p4l.completion_rate", "p4l.retries_per_synergy", "p4l.bytes_per_hop"):
        assert device.summary[key] == pytest.approx(simulated.summary[key]), key
    assert (
        device.summary["secure_aggregation"] == "paillier-1024" and device.summary["min_group"] == 2
    )


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize("crypto", ["plaintext", "paillier"])
def test_p4l_conforms(crypto):
    from p4bench.testing import check_method

    # non-private only (p4l refuses DP); 8 peers so that synergies of 5 leave models personal
    check_method(
        "p4l", options={"crypto": crypto, **SMALL_KEYS}, privacy=("no-dp",), no_dp=True, clients=8
    )


def test_accept_if_better_makes_a_private_run_uncertified_because_it_reads_records(small_config):
    """Two datasets that differ in one record change the gate's decisions: outside the ledger."""
    from p4bench.engine.evaluation import gate_received
    from p4bench.engine.threats import Defense
    from p4bench.models import LinearSoftmax

    class Gate(Defense):
        name, needs_individual_updates, gates_clients = "gate", False, True

    model = LinearSoftmax((2,), 2)
    before = {
        "params": {"weight": torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), "bias": torch.zeros(1, 2)}
    }
    after = {
        "params": {"weight": torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), "bias": torch.zeros(1, 2)}
    }

    class Deploy:
        @staticmethod
        def deployed_params(state):
            return state["params"]

    from p4bench.data import ClientTensors

    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    one = ClientTensors(
        x, torch.tensor([[0, 1]]), torch.tensor([2])
    )  # the old model fits these labels
    other = ClientTensors(
        x, torch.tensor([[1, 1]]), torch.tensor([2])
    )  # one record differs: now a tie, accepted
    kept = gate_received(Gate(small_config()), Deploy(), model, one, before, after, {})
    taken = gate_received(Gate(small_config()), Deploy(), model, other, before, after, {})
    assert torch.equal(kept["params"]["weight"], before["params"]["weight"])
    assert torch.equal(taken["params"]["weight"], after["params"]["weight"])
    result = run(
        small_config(method="fedavg", defense="accept-if-better", epsilon=4.0, rounds=2),
        track=False,
    )
    assert (
        not result.summary["epsilon_certified"]
        and "outside the ledger" in result.summary["uncertified_reason"]
    )
