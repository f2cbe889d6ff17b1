"""Every attack: the message it sends (or the labels it trains on), its options, its
timing, and the fixed malicious identities in real runs."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.errors import ConfigError, IncompatibleError
from p4bench.hookspecs import hookimpl
from p4bench.host.manager import create_plugin_manager, default_registry
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import run
from p4bench_attacks.alie import ALittleIsEnough, alie_z
from p4bench_attacks.byzantine import ByzantineFlip, ByzantineRandom, ByzantineZero
from p4bench_attacks.gaussian import Gaussian
from p4bench_attacks.ipm import InnerProductManipulation
from p4bench_attacks.label_flip import LabelFlip
from p4bench_attacks.min_max import MinMax
from p4bench_attacks.sign_flip import SignFlip


def cfg(**options) -> RunConfig:
    return RunConfig(options=options)


def msgs(src: list[int], dst: list[int], vectors: list[list[float]]) -> Messages:
    """Messages whose payload is one update tensor (n, P) plus a non-update field."""
    values = torch.tensor(vectors, dtype=torch.float32)
    return Messages(
        torch.tensor(src),
        torch.tensor(dst),
        {"update.w": values, "weight": torch.ones(len(src), dtype=torch.float64)},
    )


def rng_for(src: list[int], seed: int = 0) -> ClientRng:
    return ClientRng(node_keys(seed, src, 2))


def sent(messages: Messages) -> list[list[float]]:
    return messages.payload["update.w"].tolist()


# -- label flipping ----------------------------------------------------------------------
def test_label_flip_maps_c_to_l_minus_one_minus_c_and_keeps_padding():
    attack = LabelFlip(cfg(), num_classes=10)
    labels = torch.tensor([[0, 1, 9, 3, -1]])
    assert attack.poison_labels(labels).tolist() == [[9, 8, 0, 6, -1]]


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            {3: 4, 2: 1},
            [0, 1, 1, 4, 4],
        ),  # as FedSecurity's example: unnamed classes keep their label
        ({"3": "0"}, [0, 1, 2, 0, 4]),  # keys from a YAML file may be strings
        ([4, 3, 2, 1, 0], [4, 3, 2, 1, 0]),  # a full table
    ],
)
def test_label_map_option(spec, expected):
    attack = LabelFlip(cfg(label_map=spec), num_classes=5)
    assert attack.poison_labels(torch.arange(5).unsqueeze(0)).tolist() == [expected]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({3: 7}, r"\[0, 4\]"),
        ({-1: 2}, r"\[0, 4\]"),
        ([0, 1], "each of the 5"),
        ({2.5: 1}, "integers"),
        ({True: 1}, "integers"),
        ("3->9", "mapping"),
    ],
)
def test_bad_label_maps_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        LabelFlip(cfg(label_map=spec), num_classes=5)


# -- byzantine (P4 paper) -------------------------------------------------------------------
def test_byzantine_attacks_on_updates_replace_the_model():
    # honest delta d from reference r: the receiver rebuilds r + sent
    honest = msgs([2, 5], [-1, -1], [[1.0, 2.0], [0.5, -1.0]])
    reference = torch.tensor([[10.0, 20.0], [10.0, 20.0]])
    zero = ByzantineZero(cfg(), 10).tamper("upload", honest, rng_for([2, 5]), reference)
    assert sent(zero) == [[-10.0, -20.0], [-10.0, -20.0]]  # model = 0
    flip = ByzantineFlip(cfg(), 10).tamper("upload", honest, rng_for([2, 5]), reference)
    assert sent(flip) == [[-1.0, -2.0], [-0.5, 1.0]]  # model = r + (r - (r + d)) = r - d
    assert flip.payload["weight"].tolist() == [1.0, 1.0] and flip.src.tolist() == [2, 5]


def test_byzantine_attacks_on_models():
    honest = msgs([0], [3], [[1.0, -2.0]])
    assert sent(ByzantineZero(cfg(), 10).tamper("probe", honest, rng_for([0]))) == [[0.0, 0.0]]
    assert sent(ByzantineFlip(cfg(), 10).tamper("probe", honest, rng_for([0]))) == [[-1.0, 2.0]]


def test_byzantine_random_is_uniform_per_coordinate_and_per_client():
    honest = msgs([1, 2], [-1, -1], [[0.0] * 4000, [0.0] * 4000])
    reference = torch.full((2, 4000), 3.0)
    attack = ByzantineRandom(cfg(), 10)
    model = (
        torch.tensor(sent(attack.tamper("upload", honest, rng_for([1, 2]), reference))) + reference
    )
    assert model.min() >= -1 and model.max() < 1
    assert (
        abs(model.mean()) < 0.05 and abs(model.var() - 1 / 3) < 0.02
    )  # Uniform[-1, 1): mean 0, var 1/3
    assert not torch.equal(model[0], model[1])  # each client its own stream
    again = (
        torch.tensor(sent(attack.tamper("upload", honest, rng_for([1, 2]), reference))) + reference
    )
    assert torch.equal(model, again)  # a function of the seed


# -- literature attacks ----------------------------------------------------------------------
def test_gaussian_sends_seeded_noise_with_the_given_moments():
    honest = msgs([4], [-1], [[7.0] * 20000])
    attack = Gaussian(cfg(gaussian_mean=0.5, gaussian_std=2.0), 10)
    noise = torch.tensor(sent(attack.tamper("upload", honest, rng_for([4]))))
    assert abs(noise.mean() - 0.5) < 0.05 and abs(noise.std() - 2.0) < 0.05
    assert torch.equal(noise, torch.tensor(sent(attack.tamper("upload", honest, rng_for([4])))))
    with pytest.raises(ConfigError, match="gaussian_std"):
        Gaussian(cfg(gaussian_std=-1), 10)


def test_sign_flip_negates_the_own_update_or_the_honest_mean():
    honest = msgs([1], [0], [[2.0, -4.0]])
    observed = msgs([0, 2], [0, 0], [[4.0, 0.0], [0.0, 1.0]])
    assert sent(SignFlip(cfg(), 10).tamper("upload", honest, rng_for([1]), observed=observed)) == [
        [-2.0, 4.0]
    ]
    scaled = SignFlip(cfg(sign_flip_scale=0.5), 10).tamper(
        "upload", honest, rng_for([1]), observed=observed
    )
    assert sent(scaled) == [[-1.0, 2.0]]
    mean = SignFlip(cfg(sign_flip_source="mean"), 10).tamper(
        "upload", honest, rng_for([1]), observed=observed
    )
    assert sent(mean) == [[-2.0, 1.0]]  # -(mean of [2,-4], [4,0], [0,1])


def _ipm_setup():
    # the attacker (1) and two benign clients send to receiver 0; a benign update to receiver 5 is not in the pool
    honest = msgs([1], [0], [[2.0, 0.0]])
    observed = msgs([0, 2, 3], [0, 0, 5], [[4.0, 2.0], [0.0, 4.0], [100.0, 100.0]])
    return honest, observed


def test_ipm_sends_minus_epsilon_times_the_honest_mean_of_its_receiver():
    honest, observed = _ipm_setup()
    out = InnerProductManipulation(cfg(), 10).tamper(
        "upload", honest, rng_for([1]), observed=observed
    )
    assert sent(out)[0] == pytest.approx([-0.2, -0.2])  # mean [2, 2], epsilon 0.1
    out = InnerProductManipulation(cfg(ipm_epsilon=2), 10).tamper(
        "upload", honest, rng_for([1]), observed=observed
    )
    assert sent(out)[0] == pytest.approx([-4.0, -4.0])
    # without observed messages (one node per process) the attackers use their own updates
    alone = InnerProductManipulation(cfg(), 10).tamper("upload", honest, rng_for([1]))
    assert sent(alone)[0] == pytest.approx([-0.2, 0.0])


def test_alie_z_of_baruch_et_al():
    normal = statistics.NormalDist()
    # s = floor(n/2 + 1) - m supporters, z = Phi^-1((n - s) / n)
    assert alie_z(torch.tensor([20]), torch.tensor([6])).item() == pytest.approx(
        normal.inv_cdf(15 / 20)
    )
    assert alie_z(torch.tensor([5]), torch.tensor([1])).item() == pytest.approx(
        normal.inv_cdf(3 / 5)
    )
    assert alie_z(torch.tensor([4]), torch.tensor([1])).item() == pytest.approx(0.0, abs=1e-12)


def test_alie_sends_mean_plus_z_std_of_the_honest_updates():
    honest = msgs([4], [-1], [[4.0, 1.0]])
    observed = msgs(
        [0, 1, 2, 3], [-1, -1, -1, -1], [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    )
    out = ALittleIsEnough(cfg(), 10).tamper("upload", honest, rng_for([4]), observed=observed)
    z = statistics.NormalDist().inv_cdf(3 / 5)  # n = 5, m = 1
    # pool [0..4]: mean 2, unbiased std sqrt(2.5); second coordinate has std 0
    assert sent(out)[0] == pytest.approx([2.0 + z * 2.5**0.5, 1.0], abs=1e-6)
    fixed = ALittleIsEnough(cfg(alie_z=1.0), 10).tamper(
        "upload", honest, rng_for([4]), observed=observed
    )
    assert sent(fixed)[0] == pytest.approx([2.0 + 2.5**0.5, 1.0], abs=1e-6)
    # colluders send the same vector
    both = ALittleIsEnough(cfg(), 10).tamper(
        "upload",
        msgs([4, 5], [-1, -1], [[4.0, 1.0], [9.0, 1.0]]),
        rng_for([4, 5]),
        observed=observed,
    )
    assert sent(both)[0] == sent(both)[1]


@pytest.mark.parametrize("direction", ["std", "unit-vec", "sign"])
def test_min_max_on_a_line(direction):
    # honest 0, 1, 2: mean 1, std 1, spread 2; mal = 1 - gamma stays within 2 of every honest
    # update while 1 + gamma <= 2, so gamma = 1 and the attackers send 0
    honest = msgs([2], [0], [[2.0]])
    observed = msgs([0, 1], [0, 0], [[0.0], [1.0]])
    out = MinMax(cfg(minmax_direction=direction), 10).tamper(
        "upload", honest, rng_for([2]), observed=observed
    )
    assert sent(out)[0][0] == pytest.approx(0.0, abs=1e-4)


def test_min_max_gamma_is_maximal_per_receiver():
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(7, 3, generator=generator)
    honest = msgs([0, 1], [0, 1], [[0.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    observed = msgs(list(range(2, 9)), [0] * 7, pool.tolist())
    out = torch.tensor(
        sent(MinMax(cfg(), 10).tamper("upload", honest, rng_for([0, 1]), observed=observed))
    )
    everyone = torch.cat([torch.zeros(1, 3), pool]).double()
    spread = torch.cdist(everyone, everyone).max()
    mean, std = everyone.mean(0), everyone.std(0)
    distance = lambda v: (everyone - v).norm(dim=1).max()  # noqa: E731
    assert distance(out[0].double()) <= spread + 1e-5
    gamma = ((mean - out[0].double()) / std).mean()
    assert (
        distance(mean - 1.001 * gamma * std) > spread
    )  # a slightly larger gamma leaves the spread
    assert sent(msgs([1], [1], out[1:].tolist()))[0] == pytest.approx(
        [5.0, 5.0, 5.0]
    )  # a lone pool: its own update


def test_min_max_of_a_small_pool_ignores_the_padding_of_a_larger_one():
    # receivers see pools of 8 and 3 updates far from zero: the smaller pool is padded to 8
    # rows, and those rows must count neither in its spread nor in its distances
    generator = torch.Generator().manual_seed(1)
    big, small = (
        50 + torch.randn(7, 3, generator=generator),
        80 + torch.randn(2, 3, generator=generator),
    )
    own = [[50.0, 50.0, 50.0], [80.0, 81.0, 79.0]]
    observed = msgs(list(range(2, 11)), [0] * 7 + [1] * 2, torch.cat([big, small]).tolist())
    both = sent(
        MinMax(cfg(), 10).tamper(
            "upload", msgs([0, 1], [0, 1], own), rng_for([0, 1]), observed=observed
        )
    )
    alone = sent(
        MinMax(cfg(), 10).tamper(
            "upload",
            msgs([1], [1], own[1:]),
            rng_for([1]),
            observed=msgs([9, 10], [1, 1], small.tolist()),
        )
    )
    assert both[1] == pytest.approx(alone[0], abs=1e-4)
    pool = torch.cat([torch.tensor(own[1:]), small]).double()
    assert (pool - torch.tensor(both[1]).double()).norm(dim=1).max() <= torch.cdist(
        pool, pool
    ).max() + 1e-4


def test_omniscient_option_validation():
    with pytest.raises(ConfigError, match="minmax_direction"):
        MinMax(cfg(minmax_direction="up"), 10)
    with pytest.raises(ConfigError, match="ipm_epsilon"):
        InnerProductManipulation(cfg(ipm_epsilon=0), 10)
    with pytest.raises(ConfigError, match="sign_flip_source"):
        SignFlip(cfg(sign_flip_source="theirs"), 10)


# -- timing, compatibility, identities ----------------------------------------------------------
def test_attack_timing():
    after = ByzantineZero(cfg(), 10)
    assert not after.acts_in("grouping") and after.acts_in("cotraining") and after.acts_in("train")
    before = ByzantineZero(cfg(attack_timing="before-grouping"), 10)
    assert before.acts_in("grouping") and before.acts_in("cotraining")
    with pytest.raises(ConfigError, match="attack_timing"):
        ByzantineZero(cfg(attack_timing="sometimes"), 10)


def test_message_attacks_need_a_method_that_sends_updates(small_config):
    with pytest.raises(IncompatibleError, match="sends none"):
        run(small_config(method="local", attack="byzantine-zero"), track=False)
    poisoned = run(
        small_config(method="local", attack="label-flip", rounds=1), track=False
    )  # data poisoning still applies
    assert poisoned.info.malicious.sum() == 2


def test_every_attack_is_listed_with_a_description():
    entries = {e.name: e for e in default_registry().entries("attack")}
    expected = {
        "label-flip",
        "byzantine-zero",
        "byzantine-random",
        "byzantine-flip",
        "gaussian",
        "sign-flip",
        "alie",
        "ipm",
        "min-max",
    }
    assert expected <= set(entries)
    assert all(
        entries[name].description and "\n" not in entries[name].description for name in expected
    )


class Recording(ByzantineZero):
    """byzantine-zero that records which clients tampered, exchange by exchange."""

    name = "recording-zero"
    calls: list[tuple[str, list[int]]] = []

    def tamper(self, exchange, messages, rng, reference=None):
        Recording.calls.append((exchange, sorted(set(messages.src.tolist()))))
        return super().tamper(exchange, messages, rng, reference)


class Sniffing(ALittleIsEnough):
    """alie that records how many benign messages it observed."""

    name = "sniffing-alie"
    observed: list[int] = []

    def tamper(self, exchange, messages, rng, reference=None, observed=None, colluding=None):
        Sniffing.observed.append((len(observed), len(colluding)))
        return super().tamper(
            exchange, messages, rng, reference, observed=observed, colluding=colluding
        )


class Plugin:
    @hookimpl
    def register_attacks(self):
        return [Recording, Sniffing]


def _run(config):
    return run(
        config,
        plugin_manager=create_plugin_manager(extra_plugins=(Plugin(),), autoload=False),
        track=False,
    )


def test_malicious_identities_are_fixed_for_the_run_and_across_defenses(small_config):
    base = dict(
        method="fedavg", clients=10, rounds=3, attack="recording-zero", malicious_fraction=0.3
    )
    chosen = []
    for defense in ("none", "m-krum", "ideal", "p4-secure"):
        Recording.calls = []
        result = _run(small_config(**base, defense=defense))
        bad = sorted(np.flatnonzero(result.info.malicious).tolist())
        assert len(bad) == 3
        assert [c for c in Recording.calls] == [
            ("upload", bad)
        ] * 3  # the same clients, every round
        chosen.append(bad)
    p4 = _run(small_config(**{**base, "method": "p4"}))
    assert (
        all(c == chosen[0] for c in chosen)
        and np.flatnonzero(p4.info.malicious).tolist() == chosen[0]
    )
    other = _run(small_config(**base, seed=2))
    assert np.flatnonzero(other.info.malicious).tolist() != chosen[0]


def test_omniscient_attacks_observe_the_benign_messages_in_process(small_config):
    config = small_config(
        method="fedavg", clients=10, rounds=2, attack="sniffing-alie", defense="none"
    )
    Sniffing.observed = []
    batched = _run(config)
    assert (
        Sniffing.observed == [(7, 0)] * 2
    )  # 10 clients, 3 malicious (all in this call), every round
    Sniffing.observed = []
    reference = _run(config.replace(runtime="reference"))
    assert (
        Sniffing.observed == [(7, 2)] * 6
    )  # one call per attacker: every benign update, 2 colluders
    for key, value in batched.outcome.final_params.items():
        assert torch.allclose(value, reference.outcome.final_params[key], atol=1e-5), key


@pytest.mark.parametrize(
    "attack",
    [
        "label-flip",
        "byzantine-zero",
        "byzantine-random",
        "byzantine-flip",
        "gaussian",
        "sign-flip",
        "alie",
        "ipm",
        "min-max",
    ],
)
def test_every_attack_runs_against_p4_before_grouping(small_config, attack):
    options = {"group_size": 4, "attack_timing": "before-grouping"}
    result = run(
        small_config(method="p4", clients=12, rounds=1, attack=attack, options=options), track=False
    )
    assert np.isfinite(result.summary["accuracy_mean"])


def test_byzantine_random_hurts_an_undefended_fedavg_and_ideal_repairs_it(small_config):
    base = dict(
        method="fedavg", clients=10, rounds=3, attack="byzantine-random", malicious_fraction=0.3
    )
    clean = run(small_config(**{**base, "attack": None}, defense="none"), track=False).summary[
        "accuracy_mean"
    ]
    attacked = run(small_config(**base, defense="none"), track=False).summary["accuracy_mean"]
    ideal = run(small_config(**base, defense="ideal"), track=False).summary["accuracy_mean"]
    assert attacked < clean - 0.05
    assert ideal > attacked + 0.05
