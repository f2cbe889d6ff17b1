"""The P4L paper's attacks: label-flip-pair, label-flip-random-pair, label-shuffle (data
poisoning) and kde-noise (its noisy peers, resampling the last layers from a KDE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.errors import ConfigError
from p4bench.host.manager import Registry, create_plugin_manager, default_registry
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import prepare, run
from p4bench.testing import check_attack
from p4bench_attacks.kde_noise import KDENoise, scott_bandwidth
from p4bench_attacks.label_pair import LabelFlipPair, LabelFlipRandomPair
from p4bench_attacks.label_shuffle import LabelShuffle

NAMES = ("label-flip-pair", "label-flip-random-pair", "label-shuffle", "kde-noise")


def cfg(**options) -> RunConfig:
    return RunConfig(options=options)


def rng_for(clients: list[int], seed: int = 0) -> ClientRng:
    return ClientRng(node_keys(seed, clients, 2))


def every_class(rows: int, classes: int = 10) -> torch.Tensor:
    """(rows, L + 2): each class once per row, then two padding entries."""
    return torch.cat([torch.arange(classes).repeat(rows, 1), torch.full((rows, 2), -1)], dim=1)


def swapped_pair(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """The pair a row of `every_class` labels had swapped; fails unless exactly one pair was."""
    changed = torch.nonzero(before != after).flatten().tolist()
    assert len(changed) == 2, changed
    a, b = changed
    assert after[a] == before[b] and after[b] == before[a]
    return int(before[a]), int(before[b])


# -- label-flip-pair -------------------------------------------------------------------------
def test_label_flip_pair_swaps_exactly_the_pair_and_keeps_padding():
    labels = torch.tensor([[0, 5, 1, 5, 0, 9, -1], [3, 3, 3, 3, 3, 3, 10]])
    assert LabelFlipPair(cfg(), 10).poison_labels(labels).tolist() == [
        [5, 0, 1, 0, 5, 9, -1],
        [3] * 6 + [10],
    ]
    binary = LabelFlipPair(cfg(flip_pair=[1, 0]), 2).poison_labels(torch.tensor([[0, 1, 1, -1]]))
    assert binary.tolist() == [[1, 0, 0, -1]]
    assert LabelFlipPair(cfg(flip_pair=["2", "7"]), 10).pair == (2, 7)  # `-o` / YAML text


@pytest.mark.parametrize(
    "pair, message",
    [
        ([0, 0], "different"),
        ([0, 10], r"\[0, 9\]"),
        ([-1, 3], r"\[0, 9\]"),
        ([1, 2, 3], "two class"),
        (3, "two class"),
        ("0,5", "two class"),
        ([0.5, 1], "integers"),
        ([True, 2], "integers"),
        (["a", 2], "integers"),
    ],
)
def test_bad_pairs_are_refused_naming_the_option(pair, message):
    with pytest.raises(ConfigError, match=message) as info:
        LabelFlipPair(cfg(flip_pair=pair), 10)
    assert info.value.field == "options.flip_pair"


def test_the_default_pair_needs_six_classes():
    with pytest.raises(ConfigError, match="flip_pair"):
        LabelFlipPair(cfg(), 2)  # binary tasks pass [0, 1]


# -- label-flip-random-pair ------------------------------------------------------------------
def test_random_pair_swaps_one_pair_per_client_reproducibly():
    attack = LabelFlipRandomPair(cfg(), 10)
    clients = list(range(12))
    labels = every_class(len(clients))
    poisoned = attack.poison_labels(labels, rng=rng_for(clients))
    pairs = [swapped_pair(labels[i], poisoned[i]) for i in range(len(clients))]
    assert (poisoned[:, -2:] == -1).all()  # padding
    assert len({tuple(sorted(p)) for p in pairs}) > 1  # clients get different pairs
    assert torch.equal(
        attack.poison_labels(labels, rng=rng_for(clients)), poisoned
    )  # same seed, same pairs
    other = attack.poison_labels(labels, rng=rng_for(clients, seed=1))
    assert [swapped_pair(labels[i], other[i]) for i in range(len(clients))] != pairs
    alone = attack.poison_labels(
        labels[5:6], rng=rng_for([5])
    )  # a client's pair: its own stream only
    assert torch.equal(alone[0], poisoned[5])
    with pytest.raises(ValueError, match="rng"):
        attack.poison_labels(labels)


def test_random_pairs_cover_every_pair():
    attack = LabelFlipRandomPair(cfg(), 4)
    first, second = attack.random_pairs(rng_for(list(range(400))))
    assert bool((first != second).all()) and first.max() < 4 and second.max() < 4
    assert {tuple(sorted(p)) for p in zip(first.tolist(), second.tolist())} == {
        (a, b) for a in range(4) for b in range(a + 1, 4)
    }


# -- label-shuffle -----------------------------------------------------------------------------
def test_label_shuffle_maps_each_client_through_a_permutation():
    attack = LabelShuffle(cfg(), 10)
    clients = list(range(8))
    labels = torch.cat(
        [every_class(len(clients)), every_class(len(clients))[:, :10]], dim=1
    )  # each class twice
    poisoned = attack.poison_labels(labels, rng=rng_for(clients))
    assert (poisoned[:, 10:12] == -1).all()
    perms = []
    for row in range(len(clients)):
        perm = poisoned[row, :10]
        assert sorted(perm.tolist()) == list(range(10))  # bijective on the classes
        assert torch.equal(poisoned[row, 12:], perm)  # the same class always gets the same label
        perms.append(perm.tolist())
    assert len({tuple(p) for p in perms}) == len(clients)  # each client its own permutation
    assert torch.equal(attack.poison_labels(labels, rng=rng_for(clients)), poisoned)
    assert not torch.equal(attack.poison_labels(labels, rng=rng_for(clients, seed=4)), poisoned)
    with pytest.raises(ValueError, match="rng"):
        attack.poison_labels(labels)


# -- kde-noise ---------------------------------------------------------------------------------
def layered(weight: torch.Tensor, **extra: torch.Tensor) -> Messages:
    """Messages with an untargeted first layer ("update.a"), a bias and `weight` (n, m)."""
    n = weight.shape[0]
    payload = {
        "update.a": torch.arange(6.0).repeat(n, 1).reshape(n, 2, 3),
        "update.bias": torch.linspace(-1, 1, 4).repeat(n, 1),
        "update.weight": weight.float(),
        "weight": torch.ones(n, dtype=torch.float64),
        **extra,
    }
    return Messages(torch.arange(n), torch.full((n,), -1), payload)


def test_bandwidth_is_scipys_default():
    stats = pytest.importorskip("scipy.stats")
    values = torch.randn(2, 500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = [float(np.sqrt(stats.gaussian_kde(row.numpy()).covariance[0, 0])) for row in values]
    assert scott_bandwidth(values).tolist() == pytest.approx(expected, rel=1e-9)


def test_kde_noise_keeps_the_layer_distribution_but_not_its_values():
    honest = 0.3 + 0.05 * torch.randn(1, 10_000, generator=torch.Generator().manual_seed(1))
    messages = layered(honest)
    out = KDENoise(cfg(kde_unit="tensor"), 10).tamper("upload", messages, rng_for([3]))
    sent = out.payload["update.weight"].double()
    assert float((sent == honest.float()).double().mean()) < 0.01  # replaced
    assert abs(float(sent.mean()) - 0.3) < 0.01 and abs(float(sent.std()) / 0.05 - 1) < 0.1
    quantiles = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    assert torch.allclose(sent.quantile(quantiles), honest.double().quantile(quantiles), atol=0.01)
    assert not torch.equal(
        out.payload["update.bias"], messages.payload["update.bias"]
    )  # layers=2: bias too
    for key in ("update.a", "weight"):  # an untargeted layer and a non-update entry
        assert torch.equal(out.payload[key], messages.payload[key])
    again = KDENoise(cfg(kde_unit="tensor"), 10).tamper("upload", messages, rng_for([3]))
    assert torch.equal(
        again.payload["update.weight"], out.payload["update.weight"]
    )  # a function of the seed


def test_kde_noise_layers_option():
    messages = layered(torch.randn(1, 50, generator=torch.Generator().manual_seed(2)))
    one = KDENoise(cfg(kde_layers=1, kde_unit="tensor"), 10).tamper(
        "upload", messages, rng_for([0])
    )
    assert torch.equal(one.payload["update.bias"], messages.payload["update.bias"])
    assert not torch.equal(one.payload["update.weight"], messages.payload["update.weight"])
    every = KDENoise(cfg(kde_layers=9, kde_unit="tensor"), 10).tamper(
        "upload", messages, rng_for([0])
    )  # more than there are: all
    assert all(
        not torch.equal(every.payload[k], messages.payload[k])
        for k in ("update.a", "update.bias", "update.weight")
    )
    with pytest.raises(ConfigError, match="kde_layers"):
        KDENoise(cfg(kde_layers=0), 10)


def test_kde_noise_is_batched_over_messages_with_their_own_distributions():
    generator = torch.Generator().manual_seed(3)
    means, stds = torch.tensor([[0.3], [-1.0], [5.0]]), torch.tensor([[0.05], [0.5], [2.0]])
    honest = means + stds * torch.randn(3, 10_000, generator=generator)
    attack = KDENoise(cfg(kde_unit="tensor"), 10)
    sent = (
        attack.tamper("upload", layered(honest), rng_for([4, 7, 9]))
        .payload["update.weight"]
        .double()
    )
    honest_mean, honest_std = honest.double().mean(dim=1), honest.double().std(dim=1)
    assert ((sent.mean(dim=1) - honest_mean).abs() < 0.05 * honest_std).all()  # 5 standard errors
    assert ((sent.std(dim=1) / honest_std - 1).abs() < 0.1).all()
    assert ((honest_std / stds.squeeze(1) - 1).abs() < 0.05).all()  # the rows do differ as intended
    alone = attack.tamper("upload", layered(honest[1:2]), rng_for([7])).payload["update.weight"]
    assert torch.equal(alone[0], sent[1].float())  # a message's draws do not depend on the batch


def test_kde_noise_on_deltas_resamples_the_honest_model():
    generator = torch.Generator().manual_seed(5)
    model = 0.3 + 0.05 * torch.randn(2, 2000, generator=generator, dtype=torch.float64)
    reference = torch.randn(
        2, 2000 + 6 + 4, generator=generator, dtype=torch.float64
    )  # a, bias, weight
    delta = model - reference[:, 10:]
    attack = KDENoise(cfg(kde_layers=1, kde_unit="tensor"), 10)
    out = attack.tamper("upload", layered(delta), rng_for([1, 2]), reference)
    rebuilt = (
        out.payload["update.weight"].double() + reference[:, 10:]
    )  # what the receiver reconstructs
    direct = (
        attack.tamper("upload", layered(model), rng_for([1, 2])).payload["update.weight"].double()
    )
    assert torch.allclose(
        rebuilt, direct, atol=1e-5
    )  # the same samples as resampling the model itself
    assert abs(float(rebuilt.mean()) - 0.3) < 0.01 and abs(float(rebuilt.std()) / 0.05 - 1) < 0.1


def test_kde_noise_on_one_flattened_vector():
    params = torch.randn(2, 300, generator=torch.Generator().manual_seed(6))
    messages = Messages(torch.tensor([0, 1]), torch.tensor([-1, -1]), {"update.params": params})
    out = KDENoise(cfg(), 10).tamper("upload", messages, rng_for([0, 1]))
    assert out.payload["update.params"].shape == params.shape
    assert not torch.equal(out.payload["update.params"], params)


def test_kde_noise_targets_the_last_dense_layers_by_depth_not_by_name():
    """cnn's parameters sorted by name put the output layer fc before the hidden fc1; the
    default (two layers) resamples both dense layers, the paper's CIFAR setting, and one
    layer is the output layer: depth comes from the shapes (fc1's outputs are fc's inputs)."""
    generator = torch.Generator().manual_seed(7)
    shapes = {
        "conv1.weight": (4, 1, 3, 3),
        "conv1.bias": (4,),
        "fc1.weight": (16, 36),
        "fc1.bias": (16,),
        "fc.weight": (10, 16),
        "fc.bias": (10,),
    }
    payload = {
        f"update.{name}": torch.randn(2, *shape, generator=generator)
        for name, shape in shapes.items()
    }
    messages = Messages(torch.tensor([0, 1]), torch.tensor([-1, -1]), payload)

    def changed(attack: KDENoise) -> set[str]:
        out = attack.tamper("upload", messages, rng_for([0, 1])).payload
        return {
            key.removeprefix("update.")
            for key in payload
            if not torch.equal(out[key], payload[key])
        }

    assert changed(KDENoise(cfg(), 10)) == {"fc1.weight", "fc1.bias", "fc.weight", "fc.bias"}
    assert changed(KDENoise(cfg(kde_layers=1), 10)) == {"fc.weight", "fc.bias"}
    assert changed(KDENoise(cfg(kde_layers=3), 10)) == set(shapes)
    assert changed(KDENoise(cfg(kde_unit="tensor"), 10)) == {
        "fc1.weight",
        "fc1.bias",
    }  # sorted names: fc1 last


# -- end to end ----------------------------------------------------------------------------------
def test_random_pair_is_applied_by_the_engine():
    config = RunConfig(
        method="fedavg",
        attack="label-flip-random-pair",
        malicious_fraction=0.25,
        clients=8,
        rounds=1,
        local_steps=1,
        seed=3,
    )
    prepared = prepare(config, Registry(create_plugin_manager()))
    prepared.runtime.execute(prepared.job, lambda report: None)
    train, malicious, flipped = prepared.job.data.train, prepared.info.malicious, 0
    for group in prepared.runtime.driver.groups:
        for position, client in enumerate(group.rows.tolist()):
            trained = group.train.y[position, : int(group.train.n[position])]
            truth = train.y[client, : int(train.n[client])]
            if not malicious[client]:
                assert torch.equal(trained, truth)
                continue
            changed = trained != truth
            moved = {(int(a), int(b)) for a, b in zip(truth[changed], trained[changed])}
            assert len({c for pair in moved for c in pair}) == 2  # one pair of classes, swapped
            flipped += int(changed.sum())
    assert flipped > 0


@pytest.mark.parametrize(
    "attack, options",
    [
        ("label-flip-pair", {}),
        ("label-flip-random-pair", {}),
        ("label-shuffle", {}),
        ("kde-noise", {"kde_layers": 1}),
    ],
)
def test_runs_with_each_attack(small_config, attack, options):
    result = run(
        small_config(
            method="fedavg",
            clients=8,
            rounds=2,
            attack=attack,
            malicious_fraction=0.25,
            options=options,
        ),
        track=False,
    )
    assert result.summary["attack"] == attack and result.info.malicious.sum() == 2
    assert np.isfinite(result.summary["accuracy_mean"])


def test_registered_with_a_description():
    entries = {e.name: e for e in default_registry().entries("attack")}
    assert all(
        entries[name].description and "\n" not in entries[name].description for name in NAMES
    )


@pytest.mark.parametrize("attack", NAMES)
def test_conforms(attack):
    check_attack(
        attack
    )  # labels/tamper contract, changes fedavg and dp-dsgd, runtimes agree, options
