"""Every defense on small hand-computed inputs, batched with padding, and in runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig
from p4bench.errors import ConfigError, IncompatibleError
from p4bench.hookspecs import hookimpl
from p4bench.host.manager import create_plugin_manager, default_registry
from p4bench.run.runner import run
from p4bench_defenses.anomaly import AnomalyDetection
from p4bench_defenses.bulyan import Bulyan
from p4bench_defenses.clipping import CenteredClipping, NormClipping
from p4bench_defenses.foolsgold import FoolsGold
from p4bench_defenses.geometric_median import GeometricMedian
from p4bench_defenses.ideal import IdealDefense
from p4bench_defenses.krum import Krum, MultiKrum, krum_scores
from p4bench_defenses.median import Median
from p4bench_defenses.trimmed_mean import TrimmedMean
from p4bench_p4.secure import P4Secure


def cfg(**options) -> RunConfig:
    return RunConfig(options=options)


def batch(*rows: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(updates (B, n, P), weights (B, n), mask (B, n)) from rows of vectors (padded)."""
    width = max(len(r) for r in rows)
    size = len(torch.as_tensor(rows[0][0], dtype=torch.float64).reshape(-1))
    updates = torch.zeros(len(rows), width, size, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        for i, vector in enumerate(row):
            updates[b, i] = torch.as_tensor(vector, dtype=torch.float64).reshape(-1)
            mask[b, i] = True
    return updates, mask.double(), mask


def ids(*rows: list[int], receivers: list[int] | None = None) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    senders = torch.full((len(rows), width), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        senders[b, : len(row)] = torch.tensor(row)
    return {
        "receivers": torch.tensor(receivers if receivers is not None else list(range(len(rows)))),
        "senders": senders,
    }


LINE = [[0.0], [1.0], [2.0], [10.0], [11.0]]


# -- Krum family -------------------------------------------------------------------------
def test_krum_scores_by_hand():
    # n = 5, f = floor(0.3 * 5) = 1: each score sums the n - f - 2 = 2 nearest squared distances
    updates, _, mask = batch(LINE)
    scores = krum_scores(updates, mask, torch.tensor([1]))
    assert scores[0].tolist() == [5.0, 2.0, 5.0, 65.0, 82.0]


@pytest.mark.parametrize(
    "options, kept, mean",
    [
        ({}, [True, True, True, True, False], 3.25),  # m = n - f = 4
        ({"krum_m": 3}, [True, True, True, False, False], 1.0),
        ({"krum_m": 1}, [False, True, False, False, False], 1.0),
    ],
)
def test_m_krum_keeps_the_m_lowest_scores(options, kept, mean):
    updates, weights, mask = batch(LINE)
    combined, chosen = MultiKrum(cfg(**options)).aggregate(updates, weights, mask)
    assert chosen[0].tolist() == kept
    assert combined[0].item() == pytest.approx(mean)


def test_krum_keeps_one_and_f_follows_the_assumed_fraction():
    updates, weights, mask = batch(LINE)
    assert Krum(cfg()).select(updates, weights, mask)[0].tolist() == [
        False,
        True,
        False,
        False,
        False,
    ]
    # assumed_fraction 0 -> f = 0: neighbours n - 2 = 3; scores 0:1+4+100, 1:1+1+81, 2:1+4+64, 10:1+64+81
    updates, weights, mask = batch(LINE)
    assert krum_scores(updates, mask, torch.tensor([0]))[0].tolist()[:3] == [105.0, 83.0, 69.0]
    kept = MultiKrum(cfg(assumed_fraction=0.0, krum_m=2)).select(updates, weights, mask)
    assert kept[0].tolist() == [False, True, True, False, False]


def test_m_krum_weights_the_kept_updates_by_sample_count():
    updates, weights, mask = batch(LINE)
    weights = torch.tensor([[1.0, 1.0, 2.0, 1.0, 1.0]])
    combined, _ = MultiKrum(cfg(krum_m=3)).aggregate(updates, weights, mask)
    assert combined[0].item() == pytest.approx((0 + 1 + 2 * 2) / 4)


def test_bad_options_fail_at_construction():
    with pytest.raises(ConfigError, match="krum_m"):
        MultiKrum(cfg(krum_m=0))
    with pytest.raises(ConfigError, match="assumed_fraction"):
        MultiKrum(cfg(assumed_fraction=0.6))
    with pytest.raises(ConfigError, match="anomaly_variant"):
        AnomalyDetection(cfg(anomaly_variant="zkp"))
    with pytest.raises(ConfigError, match="trim_fraction"):
        TrimmedMean(cfg(trim_fraction=0.5))


# -- coordinate-wise rules ----------------------------------------------------------------
def test_trimmed_mean_is_coordinate_wise():
    # per coordinate, drop the b = floor(0.2 * 5) = 1 largest and smallest values: the
    # outliers sit in different clients, so no whole-client rule gives these numbers
    rows = [[1, 3], [100, -50], [2, 0], [4, 2], [3, 1]]
    updates, weights, mask = batch(rows)
    combined, kept = TrimmedMean(cfg(trim_fraction=0.2)).aggregate(updates, weights, mask)
    assert combined[0].tolist() == [3.0, 1.0]  # mean(2, 3, 4), mean(0, 1, 2)
    assert kept.all()
    # default b = floor(assumed_fraction * n): 0.3 * 5 -> 1, same answer; 0.45 * 5 -> 2 = medians
    assert TrimmedMean(cfg()).aggregate(updates, weights, mask)[0][0].tolist() == [3.0, 1.0]
    assert TrimmedMean(cfg(trim_fraction=0.45)).aggregate(updates, weights, mask)[0][
        0
    ].tolist() == [3.0, 1.0]
    combined, _ = TrimmedMean(cfg(trim_fraction=0.0)).aggregate(updates, weights, mask)
    assert combined[0].tolist() == pytest.approx([22.0, -8.8])


def test_median_odd_even_and_padded():
    updates, weights, mask = batch([[1, 9], [5, 2], [3, 4]], [[1, 0], [7, 0], [3, 0], [100, 1]])
    combined, kept = Median(cfg()).aggregate(updates, weights, mask)
    assert combined[0].tolist() == [3.0, 4.0]
    assert combined[1].tolist() == [5.0, 0.0]  # even count: mean of the two middle values
    assert kept.equal(mask)


def test_geometric_median_by_hand():
    # on a line the geometric median is the (weighted) median; a symmetric square -> its centre
    updates, weights, mask = batch(
        [[0, 0], [1, 0], [2, 0], [3, 0], [100, 0]], [[0, 0], [1, 0], [0, 1], [1, 1]]
    )
    z, kept = GeometricMedian(cfg()).aggregate(updates, weights, mask)
    assert z[0].tolist() == pytest.approx([2.0, 0.0], abs=1e-4)
    assert z[1].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    assert kept.equal(mask)
    updates, _, mask = batch([[0.0], [1.0], [10.0]])
    z, _ = GeometricMedian(cfg()).aggregate(updates, torch.tensor([[1.0, 1.0, 5.0]]), mask)
    assert z[0].item() == pytest.approx(10.0, abs=1e-4)  # weight 5 of 7 outweighs the rest


def test_norm_clipping_by_hand():
    updates, weights, mask = batch([[3, 4], [0.6, 0.8]])
    combined, kept = NormClipping(cfg(norm_bound=2.0)).aggregate(updates, weights, mask)
    assert combined[0].tolist() == pytest.approx([0.9, 1.2])  # mean of [1.2, 1.6] and [0.6, 0.8]
    # default bound: the median norm (5 of 1, 5, 10)
    updates, weights, mask = batch([[0.6, 0.8], [3, 4], [6, 8]])
    combined, _ = NormClipping(cfg()).aggregate(updates, weights, mask)
    assert combined[0].tolist() == pytest.approx([(0.6 + 3 + 3) / 3, (0.8 + 4 + 4) / 3])
    assert kept.all()


def test_centered_clipping_moves_from_the_receivers_previous_aggregate():
    defense = CenteredClipping(cfg(cclip_tau=1.0))
    updates, weights, mask = batch([[3, 4], [0, 0.5]])
    first, _ = defense.aggregate(updates, weights, mask, **ids([0, 1], receivers=[7]))
    assert first[0].tolist() == pytest.approx(
        [0.3, 0.65]
    )  # mean of clip([3,4]) = [0.6,0.8] and [0, 0.5]
    updates, weights, mask = batch([[0.3, 2.65]])
    second, _ = defense.aggregate(updates, weights, mask, **ids([0], receivers=[7]))
    assert second[0].tolist() == pytest.approx(
        [0.3, 1.65]
    )  # v0 = first; the difference [0, 2] is clipped to [0, 1]
    other, _ = defense.aggregate(updates, weights, mask, **ids([0], receivers=[8]))
    assert other[0].tolist() == pytest.approx(
        [0.3 / math.hypot(0.3, 2.65), 2.65 / math.hypot(0.3, 2.65)]
    )  # fresh: v0 = 0


# -- filters ------------------------------------------------------------------------------
def test_foolsgold_silences_identical_sybils():
    defense = FoolsGold(cfg())
    updates, weights, mask = batch([[1, 0], [1, 0], [0, 1]])
    combined, kept = defense.aggregate(updates, weights, mask, **ids([4, 5, 6]))
    assert kept[0].tolist() == [False, False, True]  # alpha: 1 - max cosine = 0 for the pair
    assert combined[0].tolist() == [0.0, 1.0]


def test_foolsgold_remembers_histories_per_receiver_and_sender():
    defense = FoolsGold(cfg())
    updates, weights, mask = batch([[1, 0], [1, 0], [0, 1]])
    defense.aggregate(updates, weights, mask, **ids([4, 5, 6], receivers=[0]))
    # now 4 sends what 6 sends: alone, 4 and 6 look like sybils (cosine 1) and 5 is pardoned
    updates, weights, mask = batch([[0, 1], [1, 0], [0, 1]])
    _, fresh = defense.aggregate(updates, weights, mask, **ids([4, 5, 6], receivers=[1]))
    assert fresh[0].tolist() == [False, True, False]
    # at receiver 0 the histories [1,1], [2,0], [0,2] are equally similar (cos 0.71): all kept alike
    combined, remembered = defense.aggregate(
        updates, weights, mask, **ids([4, 5, 6], receivers=[0])
    )
    assert remembered[0].tolist() == [True, True, True]
    assert combined[0].tolist() == pytest.approx([1 / 3, 2 / 3])


def test_bulyan_by_hand():
    # n = 7: f = min(floor(0.3 * 7), (7 - 3) // 4) = 1, theta = 5 chosen by iterated Krum,
    # beta = 3 values per coordinate closest to the chosen median (2) -> mean(1, 2, 3)
    updates, weights, mask = batch([[0.0], [1.0], [2.0], [3.0], [4.0], [50.0], [60.0]])
    combined, chosen = Bulyan(cfg()).aggregate(updates, weights, mask)
    # Krum picks 2, then 1, 3, 0; among {4, 50, 60} with one neighbour the close pair 50/60 wins
    assert chosen[0].tolist() == [True, True, True, True, False, True, False]
    assert combined[0].item() == pytest.approx(2.0)


def test_bulyan_with_too_few_updates_is_the_mean():
    updates, weights, mask = batch([[0.0], [1.0], [2.0], [9.0]])
    combined, chosen = Bulyan(cfg()).aggregate(updates, weights, mask)
    assert chosen.all() and combined[0].item() == pytest.approx(3.0)


def test_anomaly_detection_paper_three_sigma():
    # 11 identical updates and one outlier: its z-score is sqrt(11) > 3, so it is dropped
    rows = [[0.0, 0.0]] * 11 + [[100.0, 0.0]]
    updates, weights, mask = batch(rows)
    kept = AnomalyDetection(cfg()).select(updates, weights, mask)
    assert kept[0].tolist() == [True] * 11 + [False]
    # with 10 updates the largest possible z-score is sqrt(9) = 3: the 3-sigma rule cannot fire
    updates, weights, mask = batch(rows[2:])
    assert AnomalyDetection(cfg()).select(updates, weights, mask).all()
    assert not AnomalyDetection(cfg(anomaly_lambda=2.9)).select(updates, weights, mask)[0, -1]


def test_anomaly_detection_fedml_variant():
    defense = AnomalyDetection(cfg(anomaly_variant="fedml"))
    who = ids([0, 1, 2, 3], receivers=[9])
    # first aggregation: all flagged; reference = the lowest-Krum-score update [1, 0];
    # distances 0, .1, .1, 6 -> bound mean + 0.5 * sample std = 1.55 + 0.5 * 2.967 = 3.03
    updates, weights, mask = batch([[1, 0], [1.1, 0], [0.9, 0], [-5, 0]])
    assert defense.select(updates, weights, mask, **who)[0].tolist() == [True, True, True, False]
    # an update above the bound that points the same way as before is not flagged: kept
    updates, weights, mask = batch([[1, 0], [1, 0.05], [0.9, 0], [3.5, 0]])
    assert defense.select(updates, weights, mask, **who).all()
    # one that turns against the reference (cosine -1 < 0.5) is flagged and, above the bound, dropped
    updates, weights, mask = batch([[1, 0], [1, 0.05], [0.9, 0], [-3, 0]])
    assert defense.select(updates, weights, mask, **who)[0].tolist() == [True, True, True, False]


def test_p4_secure_is_anomaly_detection_then_m_krum():
    # anomaly detection drops the 100 (z = 3.3); m-Krum on the 11 survivors keeps the
    # n - f = 8 lowest scores: the eight zeros (score 0) before the three ones (score 4)
    rows = [[0.0]] * 8 + [[1.0]] * 3 + [[100.0]]
    updates, weights, mask = batch(rows)
    combined, kept = P4Secure(cfg()).aggregate(updates, weights, mask, **ids(list(range(12))))
    assert kept[0].tolist() == [True] * 8 + [False] * 4
    assert combined[0].item() == 0.0


def test_ideal_drops_exactly_the_malicious_senders():
    defense = IdealDefense(cfg())
    defense.reveal_malicious(torch.tensor([False, True, False, True]))
    updates, weights, mask = batch([[1.0], [2.0], [3.0]], [[4.0], [5.0]])
    combined, kept = defense.aggregate(updates, weights, mask, **ids([0, 1, 2], [3, 0]))
    assert kept.tolist() == [[True, False, True], [False, True, False]]
    assert combined[:, 0].tolist() == [2.0, 5.0]
    with pytest.raises(RuntimeError, match="reveal"):
        IdealDefense(cfg()).select(updates, weights, mask, **ids([0, 1, 2], [3, 0]))


# -- batching -----------------------------------------------------------------------------
STATELESS = [
    MultiKrum,
    Krum,
    AnomalyDetection,
    Median,
    TrimmedMean,
    GeometricMedian,
    NormClipping,
    Bulyan,
    P4Secure,
]
STATEFUL = [CenteredClipping, FoolsGold]


@pytest.mark.parametrize("defense_cls", STATELESS + STATEFUL)
def test_a_padded_batch_equals_one_call_per_receiver(defense_cls):
    generator = torch.Generator().manual_seed(3)
    sizes = [6, 3, 12]
    rows = [torch.randn(n, 5, generator=generator, dtype=torch.float64) for n in sizes]
    rows[2][-1] += 50.0  # an outlier somewhere
    updates, weights, mask = batch(*[r.tolist() for r in rows])
    weights = weights * torch.arange(1, 13, dtype=torch.float64)[: weights.shape[1]]
    who = ids(*[list(range(n)) for n in sizes], receivers=[0, 1, 2])
    together, kept = defense_cls(cfg()).aggregate(updates, weights, mask, **who)
    for b, n in enumerate(sizes):
        alone = ids(list(range(n)), receivers=[b])
        single, single_kept = defense_cls(cfg()).aggregate(
            updates[b : b + 1, :n], weights[b : b + 1, :n], mask[b : b + 1, :n], **alone
        )
        assert torch.allclose(together[b], single[0], atol=1e-9), (defense_cls.name, b)
        assert kept[b, :n].equal(single_kept[0]) and not kept[b, n:].any()


# -- in runs ------------------------------------------------------------------------------
def test_every_defense_is_listed_with_a_description():
    registry = default_registry()
    expected = {
        "m-krum",
        "krum",
        "anomaly-detection",
        "median",
        "trimmed-mean",
        "geometric-median",
        "norm-clipping",
        "centered-clipping",
        "foolsgold",
        "bulyan",
        "p4-secure",
        "ideal",
    }
    entries = {e.name: e for e in registry.entries("defense")}
    assert expected <= set(entries)
    for name in expected:
        assert entries[name].description and "\n" not in entries[name].description


def test_defense_on_a_method_without_aggregation_exits_2(capsys, results_dir):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "local",
                "--defense",
                "m-krum",
                "--clients",
                "6",
                "--rounds",
                "1",
                "--results-dir",
                results_dir,
            ]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "m-krum" in err and "local" in err and "aggregates none" in err


class Metrics:
    def __init__(self):
        self.rounds: list[dict[str, float]] = []

    @hookimpl
    def round_finished(self, run, report):
        self.rounds.append(dict(report.metrics))


def _metrics(config):
    observer = Metrics()
    result = run(
        config,
        observers=[observer],
        plugin_manager=create_plugin_manager(autoload=False),
        track=False,
    )
    return result, observer.rounds


def test_detection_precision_and_recall_per_round(small_config):
    base = dict(
        method="fedavg", clients=10, rounds=3, attack="byzantine-random", malicious_fraction=0.3
    )
    _, ideal = _metrics(small_config(**base, defense="ideal"))
    assert [r["detection_precision"] for r in ideal] == [1.0] * 3
    assert [r["detection_recall"] for r in ideal] == [1.0] * 3
    assert ideal[-1]["detection_benign_dropped_total"] == 0.0
    # m-Krum keeps n - f = 7 of 10: random models are far from everything, so it drops the 3 attackers
    _, krum = _metrics(small_config(**base, defense="m-krum"))
    assert all(r["detection_precision"] == 1.0 and r["detection_recall"] == 1.0 for r in krum)
    # no defense, or one that drops nothing by design: no detection figures
    _, undefended = _metrics(small_config(**base, defense="none"))
    _, median = _metrics(small_config(**base, defense="median"))
    assert not any(k.startswith("detection") for r in undefended + median for k in r)
    # without an attack: recall undefined, every dropped update is a false positive
    _, clean = _metrics(small_config(**{**base, "attack": None}, defense="m-krum"))
    assert all(math.isnan(r["detection_recall"]) and r["detection_precision"] == 0.0 for r in clean)
    assert clean[-1]["detection_benign_dropped_total"] == pytest.approx(0.3)


def test_p4_ideal_defense_keeps_the_group_proxies_clean(small_config):
    base = dict(
        method="p4", clients=12, rounds=2, attack="byzantine-random", options={"group_size": 4}
    )
    result, rounds = _metrics(small_config(**base, defense="ideal"))
    precision = [r["detection_precision"] for r in rounds]
    assert (
        all(math.isnan(p) or p == 1.0 for p in precision) and 1.0 in precision
    )  # NaN: nothing dropped
    assert (
        rounds[-1]["detection_recall_total"] == 1.0
        and rounds[-1]["detection_benign_dropped_total"] == 0.0
    )
    assert np.isfinite(result.summary["accuracy_mean"])


def test_unknown_defense_option_values_fail_before_training(small_config):
    with pytest.raises(ConfigError, match="krum_m"):
        run(small_config(method="fedavg", defense="m-krum", options={"krum_m": -1}), track=False)
    with pytest.raises(IncompatibleError, match="aggregates none"):
        run(small_config(method="local", defense="median"), track=False)
