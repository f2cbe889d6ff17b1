"""The gossip defenses (issue 47): clipped-gossip, cs-plus-rg and nna, on hand-built gossip
rounds over small graphs (a ring and a complete graph with Metropolis weights, as DP-DSGD
mixes) and in short runs through the command line."""

from __future__ import annotations

import json

import pytest
import torch

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.engine.threats import Defense
from p4bench.testing import check_defense
from p4bench_defenses.clipped_gossip import ClippedGossip
from p4bench_defenses.cs_plus_rg import CSPlusRG
from p4bench_defenses.nna import NearestNeighbourAveraging

NODES, SIZE, HUGE = 8, 5, 1e6
GOSSIP = [ClippedGossip, CSPlusRG, NearestNeighbourAveraging]
NAMES = [cls.name for cls in GOSSIP]


def metropolis(kind: str, n: int = NODES) -> torch.Tensor:
    """(n, n) W of a ring, a ring with two chords (unequal weights) or a complete graph:
    W_ij = 1 / (1 + max(deg_i, deg_j)), W_ii the rest."""
    if kind == "complete":
        adjacency = ~torch.eye(n, dtype=torch.bool)
    else:
        adjacency = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            adjacency[i, (i + 1) % n] = adjacency[i, (i - 1) % n] = True
        if kind == "chords":
            adjacency[0, 4] = adjacency[4, 0] = adjacency[1, 4] = adjacency[4, 1] = True
    degree = adjacency.sum(1).double()
    w = torch.where(
        adjacency, 1 / (1 + torch.maximum(degree[:, None], degree[None, :])), 0.0
    ).double()
    return w + torch.diag(1 - w.sum(1))


def inboxes(w: torch.Tensor, x: torch.Tensor):
    """What each node receives in one gossip round, as the aggregator pads it: (updates
    (B, n, P), weights (B, n), mask (B, n), identities), the own model among them."""
    width = int((w > 0).sum(1).max())
    updates = torch.zeros(len(w), width, x.shape[1], dtype=torch.float64)
    weights = torch.zeros(len(w), width, dtype=torch.float64)
    senders = torch.full((len(w), width), -1)
    for i in range(len(w)):
        peers = (w[i] > 0).nonzero().flatten()
        updates[i, : len(peers)], weights[i, : len(peers)] = x[peers], w[i, peers]
        senders[i, : len(peers)] = peers
    return updates, weights, senders >= 0, {"receivers": torch.arange(len(w)), "senders": senders}


def gossip(defense: Defense, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    updates, weights, mask, identities = inboxes(w, x)
    mixed, kept = defense.aggregate(updates, weights, mask, **identities)
    assert not (kept & ~mask).any()
    return mixed


def models(seed: int = 0) -> torch.Tensor:
    return torch.randn(NODES, SIZE, generator=torch.Generator().manual_seed(seed)).double()


def make(cls: type[Defense], **options) -> Defense:
    return cls(RunConfig(options=options))


# -- (a) no attacker: plain gossip ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["ring", "chords", "complete"])
@pytest.mark.parametrize(
    "cls, options",
    [
        (ClippedGossip, {}),
        (ClippedGossip, {"clipped_gossip_rule": "theory"}),
        (CSPlusRG, {}),
        (CSPlusRG, {"cs_plus_clipped": "b"}),
        (NearestNeighbourAveraging, {}),
        (NearestNeighbourAveraging, {"nna_variant": "each"}),
    ],
)
def test_planning_for_no_byzantine_neighbour_is_plain_gossip(kind, cls, options):
    if options.get("nna_variant") == "each" and kind == "chords":
        pytest.skip("NNM's means are unweighted: plain gossip only where W's weights are equal")
    w, x = metropolis(kind), models()
    mixed = gossip(make(cls, byzantine_neighbours=0, **options), w, x)
    assert torch.allclose(mixed, w @ x, atol=1e-12, rtol=0), cls.name


@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
def test_without_attacker_repeated_rounds_reach_consensus_near_the_plain_one(cls):
    # default b = ceil(0.3 * 7) = 3 neighbours planned for on the complete graph
    w, x0 = metropolis("complete"), models(1)
    x, defense = x0.clone(), make(cls)
    for _ in range(300):
        x = gossip(defense, w, x)
    spread = float(torch.cdist(x0, x0).max())
    assert float(torch.cdist(x, x).max()) < 0.01 * spread, cls.name  # consensus
    plain = x0.mean(0)  # plain gossip's limit: W is doubly stochastic
    assert float((x.mean(0) - plain).norm()) < 0.2 * spread, cls.name


def test_cs_plus_rg_does_not_move_where_2b_reaches_every_neighbour():
    # ring, b = 1: the 2 largest of 2 neighbour differences are clipped to the own one's 0
    w, x = metropolis("ring"), models()
    assert torch.equal(gossip(make(CSPlusRG), w, x), x)
    # clipping only the b = 1 largest, it mixes
    assert not torch.allclose(gossip(make(CSPlusRG, cs_plus_clipped="b"), w, x), x)


# -- (b) one attacker sending a huge vector -------------------------------------------------
def attacked(kind: str, seed: int = 0):
    """Node 0 sends HUGE in every coordinate to its neighbours; the honest receivers it reaches."""
    w, x = metropolis(kind), models(seed)
    updates, weights, mask, identities = inboxes(w, x)
    updates[identities["senders"] == 0] = HUGE
    victims = [i for i in range(1, NODES) if w[i, 0] > 0]
    return w, x, (updates, weights, mask, identities), victims


@pytest.mark.parametrize("kind", ["ring", "chords", "complete"])
@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
@pytest.mark.parametrize("planned", [None, 1])
def test_a_huge_vector_moves_honest_receivers_within_their_honest_neighbourhood(cls, kind, planned):
    w, x, (updates, weights, mask, identities), victims = attacked(kind)
    options = {} if planned is None else {"byzantine_neighbours": planned}
    mixed, _ = make(cls, **options).aggregate(updates, weights, mask, **identities)
    plain = torch.bmm((weights / weights.sum(1, keepdim=True)).unsqueeze(1), updates).squeeze(1)
    for i in victims:
        reach = max(float((x[j] - x[i]).norm()) for j in range(1, NODES) if w[i, j] > 0)
        assert float((mixed[i] - x[i]).norm()) <= reach + 1e-9, (cls.name, i)
        assert float((plain[i] - x[i]).norm()) > 1e5  # undefended: dragged away
    honest = [i for i in range(1, NODES) if i not in victims]
    assert all(torch.isfinite(mixed[i]).all() for i in honest)


@pytest.mark.parametrize("kind", ["ring", "chords", "complete"])
def test_clipped_gossip_s_attacker_moves_a_receiver_by_at_most_tau_times_its_weight(kind):
    tau = 0.25
    w, x, (updates, weights, mask, identities), victims = attacked(kind)
    defense = make(ClippedGossip, clipped_gossip_tau=tau)
    mixed, _ = defense.aggregate(updates, weights, mask, **identities)
    silent = updates.clone()  # the attacker sends each receiver its own model: no pull
    from_attacker = identities["senders"] == 0
    silent[from_attacker] = x[from_attacker.nonzero()[:, 0]]
    baseline, _ = defense.aggregate(silent, weights, mask, **identities)
    for i in victims:
        pull = float((mixed[i] - baseline[i]).norm())
        assert pull <= tau * float(w[i, 0]) + 1e-12
        assert pull > 0.99 * tau * float(w[i, 0])  # and the bound is what it uses


def test_nna_drops_the_far_vector_and_its_nnm_variant_is_not_bounded():
    w, x, (updates, weights, mask, identities), victims = attacked("complete")
    _, kept = make(NearestNeighbourAveraging).aggregate(updates, weights, mask, **identities)
    from_attacker = identities["senders"][victims] == 0
    assert not kept[victims][from_attacker].any() and kept[victims].any(dim=1).all()
    # NNM then a plain mean: the huge vector's own replacement still carries HUGE / (n - f)
    mixed, _ = make(NearestNeighbourAveraging, nna_variant="each").aggregate(
        updates, weights, mask, **identities
    )
    assert float((mixed[victims[0]] - x[victims[0]]).norm()) > HUGE / 100


@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
def test_nan_and_absent_messages_are_ignored(cls):
    w, x = metropolis("complete"), models()
    updates, weights, mask, identities = inboxes(w, x)
    updates[1, 2] = float("nan")  # receiver 1: one neighbour's message is NaN
    mask[2, 3] = False  # receiver 2: one message never arrived
    mixed, kept = make(cls, byzantine_neighbours=0).aggregate(updates, weights, mask, **identities)
    assert torch.isfinite(mixed).all() and not kept[1, 2] and not kept[2, 3]
    for i, gone in ((1, 2), (2, 3)):
        present = [j for j in range(NODES) if j != identities["senders"][i, gone]]
        expected = (w[i, present] @ x[present]) / w[i, present].sum()
        assert torch.allclose(mixed[i], expected, atol=1e-12), cls.name


@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
def test_identical_models_stay_and_a_sender_counts_once(cls):
    w = metropolis("complete")
    same = torch.full((NODES, SIZE), 0.01, dtype=torch.float64)
    assert torch.allclose(gossip(make(cls), w, same), same, atol=1e-15)
    # receiver 1 gets node 0's message a second time, pulled far away: the screen drops it
    updates, weights, mask, identities = inboxes(w, models())
    identities["senders"][1, 2] = 0
    updates[1, 2] = HUGE
    mixed, kept = make(cls).aggregate(updates, weights, mask, **identities)
    assert not kept[1, 2] and float(mixed[1].abs().max()) < 100.0


@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
def test_without_its_own_model_a_receiver_centres_on_the_median(cls):
    # a server-style inbox (FedAvg): no message from the receiver itself
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [HUGE]], dtype=torch.float64)
    identities = {"receivers": torch.tensor([9]), "senders": torch.arange(5).unsqueeze(0)}
    ones = torch.ones(1, 5, dtype=torch.float64)
    mixed, _ = make(cls, byzantine_neighbours=1).aggregate(
        x.unsqueeze(0), ones, ones.bool(), **identities
    )
    assert 0.0 <= float(mixed[0, 0]) <= 3.0, cls.name


@pytest.mark.parametrize("cls", GOSSIP, ids=NAMES)
def test_a_padded_batch_equals_one_call_per_receiver(cls):
    generator = torch.Generator().manual_seed(3)
    sizes, width = [6, 3, 8], 8
    updates = torch.zeros(3, width, SIZE, dtype=torch.float64)
    weights = torch.zeros(3, width, dtype=torch.float64)
    senders = torch.full((3, width), -1)
    for b, n in enumerate(sizes):
        updates[b, :n] = torch.randn(n, SIZE, generator=generator, dtype=torch.float64)
        weights[b, :n] = torch.rand(n, generator=generator, dtype=torch.float64) + 0.1
        senders[b, :n] = torch.randperm(n, generator=generator) + b  # receiver b is among them
    updates[2, -1] += 50.0  # an outlier
    mask, receivers = senders >= 0, torch.arange(3)
    together, kept = make(cls).aggregate(
        updates, weights, mask, receivers=receivers, senders=senders
    )
    for b, n in enumerate(sizes):
        single, single_kept = make(cls).aggregate(
            updates[b : b + 1, :n],
            weights[b : b + 1, :n],
            mask[b : b + 1, :n],
            receivers=receivers[b : b + 1],
            senders=senders[b : b + 1, :n],
        )
        assert torch.allclose(together[b], single[0], atol=1e-12), (cls.name, b)
        assert kept[b, :n].equal(single_kept[0]) and not kept[b, n:].any()


@pytest.mark.parametrize("name", NAMES)
def test_defense_conforms(name):
    check_defense(name, methods=("dp-dsgd", "local"), runtimes=("simulation", "reference"))


# -- (c) in a run ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_a_short_dp_dsgd_run_under_sign_flip_names_the_defense(name, capsys, results_dir):
    args = ["run", "--method", "dp-dsgd", "--defense", name, "--attack", "sign-flip"]
    args += ["--clients", "8", "--rounds", "2", "--dataset", "digits"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--results-dir", results_dir, "--json"])
    out, _ = capsys.readouterr()
    assert (info.value.code or 0) == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["defense"] == name and summary["attack"] == "sign-flip"
    assert 0.0 <= summary["accuracy_mean"] <= 1.0
