"""Gossip attacks (`dissensus`, `spectral`): the per-receiver models they craft, that they
keep honest gossip from agreeing, and that runs with them finish and repeat from the seed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.engine.method_kit import Edges, GraphSchedule, send_along
from p4bench.errors import IncompatibleError
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import run
from p4bench.testing import check_attack
from p4bench.topology import metropolis_hastings, uniform_averaging
from p4bench_attacks.dissensus import Dissensus
from p4bench_attacks.spectral import Spectral, fiedler_vector

ATTACKS = {"dissensus": Dissensus, "spectral": Spectral}
EPSILON = {"dissensus": "dissensus_epsilon", "spectral": "spectral_epsilon"}


def rng_for(messages: Messages) -> ClientRng:
    return ClientRng(node_keys(0, messages.src, 2))


def gossip_messages(models: torch.Tensor, edges: Edges) -> Messages:
    """Every node sends its model to each neighbour and itself (as DP-DSGD's gossip)."""
    rows = torch.arange(len(models))
    return send_along(rows, edges, {"update.w": models, "weight": torch.ones(len(models))})


def attacked(attack, messages: Messages, malicious: torch.Tensor) -> Messages:
    """`messages` with the malicious senders' ones as `attack` sends them (all colluding
    attackers in one group, the honest messages observed: the simulator's knowledge)."""
    bad = malicious[messages.src]
    mine, benign = messages.select(bad), messages.select(~bad)
    out = attack.tamper("gossip", mine, rng_for(mine), observed=benign, colluding=Messages.empty())
    payload = messages.payload["update.w"].clone()
    payload[bad] = out.payload["update.w"]
    return Messages(messages.src, messages.dst, {"update.w": payload})


def mix(messages: Messages, weights: torch.Tensor, nodes: int) -> torch.Tensor:
    """Plain gossip: x_i <- sum_j W_ij (what j sent i)."""
    w = weights[messages.dst, messages.src].unsqueeze(1)
    out = torch.zeros(nodes, messages.payload["update.w"].shape[1], dtype=torch.float64)
    return out.index_add_(0, messages.dst, w * messages.payload["update.w"])


def disagreement(models: torch.Tensor, honest: torch.Tensor) -> float:
    """Mean distance of the honest nodes to their average."""
    x = models[honest]
    return float((x - x.mean(dim=0)).norm(dim=1).mean())


def graph(name: str, nodes: int) -> np.ndarray:
    return GraphSchedule(name, None, nodes, seed=0).adjacency(0)


# -- the crafted models --------------------------------------------------------------------
def test_dissensus_sends_each_neighbour_the_papers_model_and_mixing_pushes_it_away():
    adjacency = graph("ring", 6)
    weights = torch.from_numpy(metropolis_hastings(adjacency))
    models = torch.arange(6 * 3, dtype=torch.float64).reshape(6, 3) ** 1.5
    malicious = torch.tensor([True, False, False, True, False, False])
    messages = gossip_messages(models, Edges.of(torch.from_numpy(weights.numpy() != 0)))
    attack = Dissensus(RunConfig(options={"dissensus_epsilon": 1.5}), 10)
    out = attacked(attack, messages, malicious)
    for m in range(len(out)):
        b, i = int(out.src[m]), int(out.dst[m])
        sent = out.payload["update.w"][m]
        if not malicious[b] or b == i or malicious[i]:
            assert torch.equal(sent, models[b])  # honest, to itself, or to an ally
            continue
        honest_nbrs = [j for j in range(6) if adjacency[i, j] and not malicious[j] and j != i]
        byz_nbrs = [c for c in range(6) if adjacency[i, c] and malicious[c] and c != i]
        pull = sum(weights[i, j] * (models[j] - models[i]) for j in honest_nbrs)
        expected = models[i] - 1.5 * pull / sum(weights[i, c] for c in byz_nbrs)
        assert torch.allclose(sent.double(), expected, atol=1e-9)
    # after plain mixing an attacked node moves by (1 - eps) times its honest pull
    mixed = mix(out, weights, 6)
    i = 1  # neighbours 0 (malicious) and 2 (honest)
    pull = weights[1, 2] * (models[2] - models[1])
    assert torch.allclose(mixed[i], models[i] - 0.5 * pull, atol=1e-9)


def test_dissensus_uses_the_runs_mixing_rule():
    # a star plus a leaf edge: metropolis and uniform weigh the centre's neighbours differently
    adjacency = np.zeros((5, 5), dtype=bool)
    for a, b in [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2)]:
        adjacency[a, b] = adjacency[b, a] = True
    models = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    malicious = torch.tensor([False, False, False, False, True])
    for rule, matrix in (("metropolis", metropolis_hastings), ("uniform", uniform_averaging)):
        weights = torch.from_numpy(matrix(adjacency))
        messages = gossip_messages(models, Edges.of(weights != 0))
        out = attacked(Dissensus(RunConfig(options={"mixing": rule}), 10), messages, malicious)
        mixed = mix(out, weights, 5)
        pull = sum(weights[0, j] * (models[j] - models[0]) for j in (1, 2, 3))
        assert torch.allclose(mixed[0], models[0] - 0.5 * pull, atol=1e-9), rule


def test_spectral_pushes_along_the_fiedler_vector_within_the_honest_spread():
    adjacency = graph("ring", 8)
    weights = torch.from_numpy(metropolis_hastings(adjacency))
    models = torch.randn(8, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    malicious = torch.zeros(8, dtype=torch.bool)
    malicious[0] = True
    messages = gossip_messages(models, Edges.of(weights != 0))
    out = attacked(Spectral(RunConfig(seed=4), 10), messages, malicious)
    # the honest subgraph is the path 1-2-...-7: its Fiedler vector is monotone, extremes at the ends
    v = fiedler_vector(8, torch.arange(1, 8), messages.src, messages.dst)
    assert v[0] == 0 and float(v.abs().max()) == 1
    assert abs(float(v[1])) == pytest.approx(1) and abs(float(v[7])) == pytest.approx(1)
    assert float(v[1:].sum()) == pytest.approx(0, abs=1e-9)
    assert bool((torch.diff(v[1:]) * torch.sign(v[7] - v[1]) > 0).all())
    for i in (1, 7):  # the two honest neighbours of the attacker
        sent = out.payload["update.w"][(out.src == 0) & (out.dst == i)][0].double()
        farthest = max(float((models[j] - models[i]).norm()) for j in (1, 7, 2, 6) if j != i)
        gap = float((sent - models[i]).norm())
        assert 0 < gap <= farthest + 1e-9  # spread scale, eps 1: within the farthest honest one
    push_1 = out.payload["update.w"][(out.src == 0) & (out.dst == 1)][0].double() - models[1]
    push_7 = out.payload["update.w"][(out.src == 0) & (out.dst == 7)][0].double() - models[7]
    cosine = torch.dot(push_1, push_7) / (push_1.norm() * push_7.norm())
    assert float(cosine) == pytest.approx(-1.0)  # opposite camps, one direction d


def test_without_observed_messages_the_attacks_send_honestly():
    models = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    support = torch.from_numpy(graph("ring", 4) | np.eye(4, dtype=bool))
    messages = gossip_messages(models, Edges.of(support))
    mine = messages.select(messages.src == 0)
    for cls in ATTACKS.values():
        out = cls(RunConfig(), 10).tamper("gossip", mine, rng_for(mine), observed=Messages.empty())
        assert torch.equal(out.payload["update.w"], mine.payload["update.w"])


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_gossip_attacks_conform_on_the_gossip_methods(attack):
    # layout, reproducibility, a changed outcome, every runtime agreeing, options; the kit
    # counts any refusal of a method that sends updates as unjustified, so the server
    # methods' refusal is checked below instead
    check_attack(attack, methods=("dp-dsgd", "muffliato"))


def test_server_methods_are_refused(small_config):
    for name in ATTACKS:
        with pytest.raises(IncompatibleError, match="server"):
            run(small_config(method="fedavg", attack=name, rounds=1), track=False)


# -- (a) they keep plain gossip from agreeing ------------------------------------------------
@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("topology, nodes, bad", [("ring", 8, (0,)), ("torus", 16, (0, 5))])
def test_attack_raises_honest_disagreement_under_plain_gossip(attack, topology, nodes, bad):
    adjacency = graph(topology, nodes)
    weights = torch.from_numpy(metropolis_hastings(adjacency))
    edges = Edges.of(weights != 0)
    malicious = torch.zeros(nodes, dtype=torch.bool)
    malicious[list(bad)] = True
    start = torch.randn(nodes, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # eps = 0: the attackers only echo each receiver's own model (as if they were cut off)
    echo = ATTACKS[attack](RunConfig(options={EPSILON[attack]: 0.0}), 10)
    instance = ATTACKS[attack](RunConfig(), 10)
    plain, echoed, hit = start.clone(), start.clone(), start.clone()
    for _ in range(5):
        plain = mix(gossip_messages(plain, edges), weights, nodes)
        echoed = mix(attacked(echo, gossip_messages(echoed, edges), malicious), weights, nodes)
        hit = mix(attacked(instance, gossip_messages(hit, edges), malicious), weights, nodes)
    honest = ~malicious
    assert disagreement(hit, honest) > 1.5 * disagreement(plain, honest)  # the honest run
    assert disagreement(hit, honest) > 1.5 * disagreement(echoed, honest)  # the push, not the cut


# -- (b) through the command line --------------------------------------------------------------
def test_dp_dsgd_run_with_dissensus_finishes_and_names_the_attack(capsys, results_dir):
    from p4bench.cli import main

    args = ["run", "--method", "dp-dsgd", "--attack", "dissensus", "--clients", "8"]
    with pytest.raises(SystemExit) as info:
        main(
            [*args, "--rounds", "2", "--dataset", "digits", "--results-dir", results_dir, "--json"]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["attack"] == "dissensus" and summary["method"] == "dp-dsgd"
    assert np.isfinite(summary["accuracy_mean"])


# -- (c) reproducible from the seed ------------------------------------------------------------
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attacked_runs_repeat_from_the_seed_and_change_the_outcome(small_config, attack):
    base = dict(method="dp-dsgd", rounds=2, options={"topology": "ring"})
    first = run(small_config(**base, attack=attack), track=False)
    again = run(small_config(**base, attack=attack), track=False)
    clean = run(small_config(**base), track=False)
    for key, value in first.outcome.final_params.items():
        assert torch.equal(value, again.outcome.final_params[key]), key
    assert any(
        not torch.allclose(value, clean.outcome.final_params[key])
        for key, value in first.outcome.final_params.items()
    )


def test_spectral_direction_comes_from_the_run_seed():
    nodes = 8
    weights = torch.from_numpy(metropolis_hastings(graph("ring", nodes)))
    models = torch.randn(nodes, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    messages = gossip_messages(models, Edges.of(weights != 0))
    malicious = torch.zeros(nodes, dtype=torch.bool)
    malicious[3] = True

    def sent(seed: int) -> torch.Tensor:
        return attacked(Spectral(RunConfig(seed=seed), 10), messages, malicious).payload["update.w"]

    assert torch.equal(sent(1), sent(1))
    assert not torch.allclose(sent(1), sent(2))
