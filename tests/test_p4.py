"""P4: group formation, co-training through every runtime, DP, budget, defense."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p4bench.run.runner import run
from p4bench_p4.grouping import collaboration_matrix, form_groups, pair_up, random_groups


def test_mutual_best_pairs_first_then_greedy_then_random():
    inf = np.inf
    d = np.array(
        [
            [inf, 1.0, 5.0, inf, inf],
            [1.0, inf, 2.0, inf, inf],
            [5.0, 2.0, inf, 3.0, inf],
            [inf, inf, 3.0, inf, inf],
            [inf, inf, inf, inf, inf],
        ]
    )
    pairs = pair_up(d, np.random.default_rng(0))
    assert [0, 1] in pairs  # mutual best
    assert any({2, 3} <= set(p) for p in pairs)  # 2 and 3 are each other's best once 0, 1 are taken
    assert sorted(sum(pairs, [])) == [0, 1, 2, 3, 4]  # 4 (knows nobody, odd one out) joins a pair
    assert len(pairs) == 2


def test_form_groups_covers_everyone_once_and_respects_size():
    rng = np.random.default_rng(1)
    points = rng.normal(size=(23, 3))
    d = np.abs(points[:, None] - points[None]).sum(-1)
    mask = rng.random(d.shape) < 0.5
    d = np.where(mask | mask.T, d, np.inf)
    groups = form_groups(d, 4, np.random.default_rng(2))
    flat = sorted(c for g in groups for c in g)
    assert flat == list(range(23))
    assert all(3 <= len(g) <= 7 for g in groups)
    matrix = collaboration_matrix(groups, 23)
    assert (matrix == matrix.T).all() and matrix.trace() == 0
    assert sorted(c for g in random_groups(23, 4, np.random.default_rng(0)) for c in g) == list(
        range(23)
    )


def _same_dominant_fraction(groups, dominant):
    same = total = 0
    for g in groups:
        for i in range(len(g)):
            for j in range(i + 1, len(g)):
                total += 1
                same += dominant[g[i]] == dominant[g[j]]
    return same / total


@pytest.mark.parametrize("grouping, low, high", [("similarity", 0.9, 1.0), ("random", 0.0, 0.4)])
def test_grouping_quality_on_dominant_class_partition(small_config, grouping, low, high):
    config = small_config(
        method="p4",
        partitioner="alpha",
        similarity=0.0,
        clients=40,
        rounds=1,
        no_dp=True,
        options={"group_size": 4, "grouping": grouping},
    )
    result = run(config, track=False)
    groups = result.method.groups_of(result.outcome.final_state)
    train = result.info.data.train
    dominant = [int(torch.bincount(train.y[c, : int(train.n[c])]).argmax()) for c in range(40)]
    fraction = _same_dominant_fraction(groups, dominant)
    assert low <= fraction <= high, fraction


@pytest.mark.parametrize("epsilon", [None, 20.0])
def test_p4_is_the_same_protocol_batched_and_over_bytes(small_config, epsilon):
    config = small_config(
        method="p4",
        clients=6,
        rounds=3,
        client_rate=0.5,
        epsilon=epsilon,
        options={"group_size": 2},
    )
    batched = run(config, track=False)
    over_bytes = run(config.replace(runtime="bytes"), track=False)
    for key, value in batched.outcome.final_params.items():
        assert torch.allclose(value, over_bytes.outcome.final_params[key], atol=1e-5)
    assert np.abs(batched.outcome.accuracy - over_bytes.outcome.accuracy).max() < 1e-9
    assert batched.summary["bytes_per_phase"] == over_bytes.summary["bytes_per_phase"]


def test_p4_summary_artifacts_and_privacy(small_config, tmp_path):
    config = small_config(
        method="p4",
        clients=8,
        rounds=3,
        epsilon=10.0,
        tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
    )
    result = run(config)
    summary = result.summary
    assert summary["defense"] == "p4-secure"  # P4's default defense
    assert summary["neighbouring"] == "replace-one"  # the paper's noise 2*C*sigma
    assert 0 < summary["epsilon"] <= 10.0 and summary["epsilon_rdp"] > 0
    assert set(summary["bytes_per_phase"]) == {"grouping", "cotraining"}
    assert all(v > 0 for v in summary["bytes_per_phase"].values())
    assert "accuracy_proxy_mean" in summary
    folder = Path(summary["results_dir"])
    groups = json.loads((folder / "groups.json").read_text())
    assert sorted(c for g in groups["groups"] for c in g) == list(range(8))
    assert (folder / "dissimilarity.png").read_bytes()[:4] == b"\x89PNG"


def test_p4_writes_no_m_by_m_artifact_for_many_clients(small_config, tmp_path, monkeypatch):
    import p4bench_p4.method as p4_method

    monkeypatch.setattr(p4_method, "ARTIFACT_MATRIX_CLIENTS", 4)  # 8 clients count as many here
    config = small_config(
        method="p4", clients=8, rounds=1, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"
    )
    folder = Path(run(config).summary["results_dir"])
    groups = json.loads((folder / "groups.json").read_text())
    assert sorted(c for g in groups["groups"] for c in g) == list(range(8))
    assert "collaboration_matrix" not in groups and not (folder / "dissimilarity.png").exists()


def test_p4_phase_one_is_counted_in_the_ledger(small_config):
    from p4bench import hookimpl
    from p4bench.host.manager import create_plugin_manager

    seen = []

    class Recorder:
        @hookimpl
        def privacy_release(self, run, release):
            seen.append(release.phase)

    result = run(
        small_config(method="p4", rounds=2, epsilon=10.0),
        observers=[Recorder()],
        plugin_manager=create_plugin_manager(autoload=False),
        track=False,
    )
    assert "grouping" in seen and "cotraining" in seen
    assert result.summary["epsilon"] <= 10.0


def test_defense_protects_the_shared_proxy(small_config):
    base = dict(
        method="p4",
        clients=20,
        rounds=8,
        attack="byzantine-random",
        malicious_fraction=0.3,
        options={"group_size": 4},
    )
    defended = run(small_config(**base), track=False).summary
    undefended = run(small_config(**base, defense="none"), track=False).summary
    clean = run(small_config(**{**base, "attack": None}), track=False).summary
    assert defended["defense"] == "p4-secure" and undefended["defense"] is None
    assert undefended["accuracy_proxy_mean"] < defended["accuracy_proxy_mean"]
    assert clean["accuracy_mean"] - defended["accuracy_mean"] < 0.10


def test_p4_groups_are_a_topology_for_other_methods(small_config, tmp_path):
    from p4bench.topology.groups import GroupsGraph
    from p4bench.topology.mixing import is_doubly_stochastic, metropolis_hastings

    result = run(
        small_config(method="p4", clients=8, rounds=1, options={"group_size": 4}), track=False
    )
    path = tmp_path / "groups.json"
    result.method.write_artifacts(result.outcome.final_state, tmp_path)
    adjacency = GroupsGraph({"path": str(path)}).edges(8, 0, np.random.default_rng(0))
    groups = result.method.groups_of(result.outcome.final_state)
    for group in groups:
        for i in group:
            assert set(np.flatnonzero(adjacency[i])) == set(group) - {i}
    assert is_doubly_stochastic(metropolis_hastings(adjacency))


def test_single_shared_dp_model_ablation(small_config):
    result = run(
        small_config(method="p4", clients=8, rounds=2, epsilon=10.0, options={"proxy": False}),
        track=False,
    )
    assert (
        "accuracy_proxy_mean" not in result.summary
    )  # the deployed model is the shared DP model itself
    assert torch.equal(
        result.outcome.final_params["weight"], result.outcome.final_state["proxy"]["weight"]
    )


def test_first_cotraining_round_starts_every_member_from_the_aggregators_proxy(
    small_config, monkeypatch
):
    """Deltas are taken from the model they are added to: at the first upload every member
    of a group holds the same reference proxy (the aggregator's), not its own phase-1 one."""
    from p4bench_p4.method import P4

    seen = []
    original = P4._send_upload

    def spy(self, state, ctx):
        if ctx.round == 0:
            seen.append(
                ({k: v.clone() for k, v in state["group_proxy"].items()}, state["members"].clone())
            )
        return original(self, state, ctx)

    monkeypatch.setattr(P4, "_send_upload", spy)
    run(
        small_config(method="p4", clients=8, rounds=1, epsilon=8.0, options={"group_size": 4}),
        track=False,
    )
    ((reference, members),) = seen
    flat = torch.cat([v.flatten(start_dim=1) for v in reference.values()], dim=1)
    firsts = []
    for row in members.unique(dim=0):
        group = row.nonzero().squeeze(1)
        assert len(group) == 4 and torch.equal(flat[group], flat[group[:1]].expand(len(group), -1))
        firsts.append(int(group[0]))
    assert len(firsts) == 2 and not torch.equal(
        flat[firsts[0]], flat[firsts[1]]
    )  # one start per group
