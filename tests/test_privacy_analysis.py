"""Privacy accounting: golden values, composition, monotonicity, calibration, plugins."""

from __future__ import annotations

import math

import pytest

from p4bench.errors import ConfigError, UsageError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.privacy import (
    DEFAULT_ORDERS,
    NobleAccountant,
    PrivacyAccountingError,
    PRVAccountant,
    RDPAccountant,
    ReleaseSegment,
    calibrate_accountant,
    calibrate_noise,
    compact_history,
    get_accountant,
    noble_epsilon,
    noble_epsilon_floor,
    noble_privacy_spent,
    prv_epsilon,
    prv_epsilon_history,
    rdp_epsilon,
    rdp_epsilon_history,
    rdp_privacy_spent,
)

NOBLE_DEFAULTS = dict(
    data_rate=0.2, local_steps=50, rounds=100, client_rate=0.2, clients=100, delta=2.5e-6
)


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch):
    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")


# --- RDP -----------------------------------------------------------------------------


def test_rdp_golden_proxyfl_mnist():
    # baselines-from-reference-code.md section 4: ProxyFL MNIST defaults, Opacus RDP.
    assert rdp_epsilon(
        noise_multiplier=1.0, sample_rate=0.25, steps=1200, delta=1e-3
    ) == pytest.approx(86.78, abs=0.05)


def test_rdp_golden_proxyfl_cifar():
    eps = rdp_epsilon(noise_multiplier=1.0, sample_rate=1 / 12, steps=2400, delta=1 / 3000)
    assert eps == pytest.approx(32.90, abs=0.05)


def test_rdp_grid_refines_opacus_default():
    from opacus.accountants import RDPAccountant as OpacusRDP

    assert set(OpacusRDP.DEFAULT_ALPHAS) <= set(DEFAULT_ORDERS)
    for sigma, q, steps in [(1.0, 1 / 12, 2400), (3.0, 0.05, 300)]:
        reference = OpacusRDP()
        reference.history = [(sigma, q, steps)]
        ours = rdp_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5)
        assert ours <= reference.get_epsilon(delta=1e-5) + 1e-12
        assert ours == pytest.approx(reference.get_epsilon(delta=1e-5), rel=0.01)


def test_rdp_history_composes_segments():
    whole = rdp_epsilon(noise_multiplier=1.5, sample_rate=0.1, steps=200, delta=1e-5)
    halves = rdp_epsilon_history(
        history=[(1.5, 0.1, 120), (1.5, 0.1, 80), (3.0, 0.5, 0)], delta=1e-5
    )
    assert halves == pytest.approx(whole, rel=1e-12)
    mixed = rdp_epsilon_history(history=[(1.5, 0.1, 200), (4.0, 0.2, 50)], delta=1e-5)
    assert mixed > whole
    eps, order = rdp_privacy_spent(history=[(1.5, 0.1, 200)], delta=1e-5)
    assert eps == pytest.approx(whole) and order in DEFAULT_ORDERS


def test_empty_history_costs_nothing():
    assert rdp_epsilon_history(history=[], delta=1e-5) == 0.0
    assert prv_epsilon_history(history=[(1.0, 0.1, 0)], delta=1e-5) == 0.0
    for accountant in (RDPAccountant(), PRVAccountant(), NobleAccountant()):
        assert accountant.epsilon([], 1e-5) == 0.0


@pytest.mark.parametrize("function", [rdp_epsilon, prv_epsilon])
def test_epsilon_grows_with_steps_and_falls_with_noise(function):
    by_steps = [
        function(noise_multiplier=1.2, sample_rate=0.05, steps=n, delta=1e-5)
        for n in (50, 200, 800)
    ]
    assert by_steps[0] < by_steps[1] < by_steps[2]
    by_noise = [
        function(noise_multiplier=s, sample_rate=0.05, steps=200, delta=1e-5)
        for s in (0.9, 1.5, 3.0)
    ]
    assert by_noise[0] > by_noise[1] > by_noise[2]


@pytest.mark.parametrize(
    "sigma,q,steps", [(1.0, 0.01, 1000), (2.0, 0.05, 500), (1.0, 1 / 12, 2400)]
)
def test_prv_and_rdp_roughly_agree(sigma, q, steps):
    rdp = rdp_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5)
    prv = prv_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5)
    # PRV is the tighter of the two (it is numerically close to optimal), but not wildly so.
    assert 0.75 * rdp < prv <= rdp * 1.01


def test_prv_history_composes_segments():
    whole = prv_epsilon(noise_multiplier=1.5, sample_rate=0.1, steps=200, delta=1e-5)
    parts = prv_epsilon_history(history=[(1.5, 0.1, 150), (1.5, 0.1, 50)], delta=1e-5)
    assert parts == pytest.approx(whole, abs=0.03)  # both within eps_error of the truth
    mixed = prv_epsilon_history(history=[(1.5, 0.1, 200), (4.0, 0.2, 50)], delta=1e-5)
    assert mixed > whole


def test_prv_refuses_huge_discretisations_quickly():
    with pytest.raises(PrivacyAccountingError, match="rdp"):
        prv_epsilon(noise_multiplier=0.3, sample_rate=0.5, steps=5000, delta=1e-5)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(steps=-3), "steps"),
        (dict(steps=2.5), "steps"),
        (dict(delta=1.0), "delta"),
        (dict(delta=0.0), "delta"),
    ],
)
def test_bad_inputs_name_the_field(changes, field):
    args = dict(noise_multiplier=1.0, sample_rate=0.1, steps=10, delta=1e-5) | changes
    with pytest.raises(ConfigError) as info:
        rdp_epsilon(**args)
    assert info.value.field.endswith(field)


# --- Noble, Bellet & Dieuleveut --------------------------------------------------------


def test_noble_golden_script_defaults():
    eps, order = noble_privacy_spent(noise_multiplier=60, view="third-party", **NOBLE_DEFAULTS)
    assert order == 3
    assert eps == pytest.approx(8.1914, abs=1e-3)  # best integer order
    assert eps == pytest.approx(8.19, abs=0.01)
    assert eps <= 8.1937 and 8.1937 - eps < 3e-3  # the script's fractional grid reports a bit more


def test_noble_aggregator_view_and_floor():
    third_party = noble_epsilon(noise_multiplier=60, view="third-party", **NOBLE_DEFAULTS)
    aggregator = noble_epsilon(noise_multiplier=60, view="aggregator", **NOBLE_DEFAULTS)
    assert aggregator == pytest.approx(8.25, abs=0.01) and aggregator > third_party
    huge = noble_epsilon(noise_multiplier=1e6, **NOBLE_DEFAULTS)
    floor = noble_epsilon_floor(**{k: v for k, v in NOBLE_DEFAULTS.items() if k != "clients"})
    assert huge == pytest.approx(8.188, abs=1e-3) and floor == pytest.approx(huge, abs=1e-6)
    assert floor <= third_party


@pytest.mark.parametrize(
    "local_steps,expected", [(10, 9.39), (20, 10.04), (50, 11.36), (100, 11.44)]
)
def test_noble_golden_femnist_like(local_steps, expected):
    # T=400, M=40, R=2000 (delta = 1/(M*R)), l=s=0.2, sigma=30, the script's third-party view.
    eps = noble_epsilon(
        noise_multiplier=30,
        data_rate=0.2,
        local_steps=local_steps,
        rounds=400,
        client_rate=0.2,
        clients=40,
        delta=1 / (40 * 2000),
        view="third-party",
    )
    assert eps == pytest.approx(expected, abs=0.01)


def test_noble_monotone_in_noise_and_rounds():
    values = [noble_epsilon(noise_multiplier=s, **NOBLE_DEFAULTS) for s in (0.5, 1.0, 2.0, 10.0)]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]
    fewer = noble_epsilon(noise_multiplier=2.0, **(NOBLE_DEFAULTS | {"rounds": 50}))
    assert fewer < values[2]


def test_noble_rejects_unknown_view():
    with pytest.raises(ConfigError, match="view"):
        noble_epsilon(noise_multiplier=1.0, view="neighbour", **NOBLE_DEFAULTS)


# --- accountant plugins ------------------------------------------------------------------


def test_accountants_are_registered_by_name():
    registry = Registry(create_plugin_manager(autoload=False))
    assert set(registry.names("accountant")) >= {"rdp", "prv", "noble"}
    for name in ("rdp", "prv", "noble"):
        cls = registry.get("accountant", name)
        assert cls.name == name and cls.description
        assert isinstance(get_accountant(name, registry=registry), cls)
    with pytest.raises(UsageError, match="rdp"):
        get_accountant("moments", registry=registry)


def test_rdp_accountant_takes_no_client_sampling_amplification():
    plain = ReleaseSegment(noise_multiplier=1.0, sample_rate=0.1, steps=300)
    sampled = ReleaseSegment(
        noise_multiplier=1.0, sample_rate=0.1, steps=300, client_rate=0.1, clients=50, rounds=3000
    )
    expected = rdp_epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=300, delta=1e-5)
    assert RDPAccountant().epsilon([plain], 1e-5) == pytest.approx(expected)
    assert RDPAccountant().epsilon([sampled], 1e-5) == pytest.approx(expected)


def test_noble_accountant_composes_rounds_across_segments():
    seg = ReleaseSegment(
        noise_multiplier=60,
        sample_rate=0.2,
        steps=0,
        local_steps=50,
        rounds=50,
        client_rate=0.2,
        clients=100,
    )
    split = NobleAccountant().epsilon([seg, seg], 2.5e-6)
    whole = NobleAccountant().epsilon([ReleaseSegment(**{**seg.__dict__, "rounds": 100})], 2.5e-6)
    assert split == pytest.approx(whole, rel=1e-12) == pytest.approx(8.1914, abs=1e-3)
    assert NobleAccountant().epsilon_floor([seg, seg], 2.5e-6) == pytest.approx(8.188, abs=1e-3)
    assert RDPAccountant().epsilon_floor([seg], 2.5e-6) == 0.0


def test_release_segment_defaults_and_compaction():
    a = ReleaseSegment(noise_multiplier=1.0, sample_rate=0.1, steps=10, local_steps=5)
    assert a.total_rounds == 2 and a.as_opacus() == (1.0, 0.1, 10)
    b = ReleaseSegment(noise_multiplier=1.0, sample_rate=0.1, steps=15, local_steps=5)
    c = ReleaseSegment(noise_multiplier=2.0, sample_rate=0.1, steps=5, local_steps=5)
    merged = compact_history([a, b, c, c])
    assert [s.steps for s in merged] == [25, 10]
    assert [s.total_rounds for s in merged] == [5, 2]
    with pytest.raises(ConfigError, match="view"):
        ReleaseSegment(noise_multiplier=1.0, sample_rate=0.1, steps=1, view="everyone")


# --- calibration ---------------------------------------------------------------------------


def test_calibrate_noise_never_overshoots():
    sigma = calibrate_noise(lambda s: 10.0 / s, 3.0, tolerance=0.01)
    assert 3.0 - 0.01 <= 10.0 / sigma <= 3.0
    # a target that needs doubling the initial bracket several times
    sigma = calibrate_noise(lambda s: 1000.0 / s, 0.5, tolerance=1e-3)
    assert 0.5 - 1e-3 <= 1000.0 / sigma <= 0.5


def test_calibrate_noise_unreachable_names_the_floor():
    with pytest.raises(UsageError, match="floor"):
        calibrate_noise(lambda s: 5.0 + 1.0 / s, 4.0)
    with pytest.raises(UsageError, match="floor of 8.188"):
        calibrate_noise(lambda s: 99.0, 8.0, floor=8.188)
    with pytest.raises(ConfigError):
        calibrate_noise(lambda s: 1.0 / s, -1.0)


def test_calibrate_rdp_round_trip_matches_bayrooti():
    # Bayrooti CIFAR-100: q=0.01, T=25000, epsilon 10, delta 1e-5 -> sigma 1.072 (section 4).
    template = [ReleaseSegment(noise_multiplier=1.0, sample_rate=0.01, steps=25000)]
    sigma = calibrate_accountant(
        RDPAccountant(), template, delta=1e-5, target_epsilon=10.0, tolerance=0.01
    )
    eps = rdp_epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=25000, delta=1e-5)
    assert 9.99 <= eps <= 10.0
    assert sigma == pytest.approx(1.072, abs=0.003)


def test_calibrate_prv_round_trip():
    template = [ReleaseSegment(noise_multiplier=1.0, sample_rate=0.05, steps=300)]
    sigma = calibrate_accountant(
        PRVAccountant(), template, delta=1e-5, target_epsilon=4.0, tolerance=0.02
    )
    eps = prv_epsilon(noise_multiplier=sigma, sample_rate=0.05, steps=300, delta=1e-5)
    assert 4.0 - 0.02 <= eps <= 4.0


def test_calibrate_noble_round_trip_and_floor_error():
    template = [
        ReleaseSegment(
            noise_multiplier=1.0,
            sample_rate=0.2,
            steps=0,
            local_steps=50,
            rounds=100,
            client_rate=0.2,
            clients=100,
        )
    ]
    sigma = calibrate_accountant(NobleAccountant(), template, delta=2.5e-6, target_epsilon=9.0)
    eps = noble_epsilon(noise_multiplier=sigma, **NOBLE_DEFAULTS)
    assert 8.99 <= eps <= 9.0
    with pytest.raises(UsageError, match=r"floor of 8\.188"):
        calibrate_accountant(NobleAccountant(), template, delta=2.5e-6, target_epsilon=8.0)


def test_noble_floor_is_noise_independent():
    floor = noble_epsilon_floor(
        data_rate=0.2, local_steps=50, rounds=400, client_rate=0.2, delta=1 / 80000
    )
    assert floor == pytest.approx(
        11.29, abs=0.01
    )  # FEMNIST K=50 at sigma -> infinity (section 3.8)
    assert math.isfinite(floor)


def test_accountants_declare_relation_and_round_dependence():
    assert RDPAccountant.relation == PRVAccountant.relation == "add-remove"
    assert NobleAccountant.relation == "replace-one"
    assert (
        NobleAccountant.uses_rounds
        and not RDPAccountant.uses_rounds
        and not PRVAccountant.uses_rounds
    )


def test_noble_tiny_noise_does_not_overflow():
    tiny = noble_epsilon(noise_multiplier=0.01, **NOBLE_DEFAULTS)
    assert math.isfinite(tiny) and tiny > noble_epsilon(noise_multiplier=1.0, **NOBLE_DEFAULTS)
