"""Every defense against non-finite updates, bad weights and one sender's repeated copies
(issue 30, item 2), on hand-built batches and in runs: the shared screen of
`p4bench.engine.screen` in front of every `Defense`."""

from __future__ import annotations

import math

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine.messages import Messages
from p4bench.engine.screen import finite_rows, first_per_sender, screen
from p4bench.engine.threats import (
    Aggregator,
    Attack,
    Defense,
    update_vectors,
    weighted_mean,
    with_update_vectors,
)
from p4bench.hookspecs import hookimpl
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.run.runner import run
from p4bench_defenses.krum import MultiKrum, krum_scores

SIZE, SPREAD, HONEST, COPIES = 6, 1.0, 12, 10
MU = torch.full((SIZE,), 0.2, dtype=torch.float64)
ATTACKER = HONEST + 6  # the sender of the repeated copies

# How far (max over coordinates) each family's aggregate may sit from the honest mean on
# the batch below. The honest updates are MU +- SPREAD * e_k, so their mean is MU, every
# coordinate-wise median and trimmed mean is MU exactly, and one surviving negated update
# moves a plain mean by about 0.11; without de-duplication its 10 copies would move it by
# about 0.64 (and m-Krum would keep all of them: identical copies score 0).
TOLERANCE = {
    "ideal": 1e-9,  # the oracle: exactly the honest mean
    "median": 1e-9,
    "trimmed-mean": 1e-9,
    "bulyan": 1e-9,  # coordinate-wise: MU exactly
    "geometric-median": 0.15,  # one outlier pulls a geometric median by a bounded step
    "m-krum": 0.25,
    "p4-secure": 0.25,  # the mean of n - f honest updates: drops up to 2 of the pairs
    "krum": SPREAD + 1e-9,  # one honest update: within the honest spread
    # rules that bound one update's influence but may keep the negated copy
    "anomaly-detection": 0.25,
    "foolsgold": 0.25,
    "norm-clipping": 0.25,
    "centered-clipping": 0.25,
    "accept-if-better": 0.25,
    # gossip rules centred on the receiver's own update (issue 47)
    "clipped-gossip": 0.25,
    "cs-plus-rg": 0.25,
    "nna": 0.25,
}


def defense_classes() -> list[type[Defense]]:
    registry = Registry(create_plugin_manager(autoload=False))
    return [registry.get("defense", name) for name in registry.names("defense")]


def build(cls: type[Defense], **options) -> Defense:
    defense = cls(RunConfig(options=options))
    if cls.needs_oracle:
        malicious = torch.zeros(ATTACKER + 1, dtype=torch.bool)
        malicious[ATTACKER] = (
            True  # only the copier: the non-finite senders must fall to the screen
        )
        defense.reveal_malicious(malicious)
    return defense


def hostile_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """(updates (n, P), weights (n,), senders (n,), labels): 12 honest updates, NaN, +inf,
    -inf updates, far updates with a NaN, +inf and negative weight, and 10 copies of one
    negated honest update from one sender."""
    eye = torch.eye(SIZE, dtype=torch.float64)
    honest = torch.cat((MU + SPREAD * eye, MU - SPREAD * eye))
    rows, weights, labels = list(honest), [1.0] * HONEST, ["honest"] * HONEST
    for value in (math.nan, math.inf, -math.inf):
        bad = MU.clone()
        bad[2] = value
        rows.append(bad)
        weights.append(1.0)
        labels.append(f"update {value}")
    for weight in (math.nan, math.inf, -1.0):
        rows.append(torch.full((SIZE,), 50.0, dtype=torch.float64))
        weights.append(weight)
        labels.append(f"weight {weight}")
    rows += [-honest[0]] * COPIES
    weights += [1.0] * COPIES
    labels += ["copy"] * COPIES
    senders = list(range(ATTACKER)) + [ATTACKER] * COPIES
    return (
        torch.stack(rows),
        torch.tensor(weights, dtype=torch.float64),
        torch.tensor(senders),
        labels,
    )


def hostile_batch() -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], list[list[str]]
]:
    """Two receivers: the hostile row in order, and reversed with two padded slots."""
    updates, weights, senders, labels = hostile_row()
    n = len(labels)
    order = torch.arange(n - 1, -1, -1)
    batch_updates = torch.zeros(2, n + 2, SIZE, dtype=torch.float64)
    batch_weights = torch.zeros(2, n + 2, dtype=torch.float64)
    batch_senders = torch.full((2, n + 2), -1)
    batch_updates[0, :n], batch_weights[0, :n], batch_senders[0, :n] = updates, weights, senders
    batch_updates[1, :n], batch_weights[1, :n], batch_senders[1, :n] = (
        updates[order],
        weights[order],
        senders[order],
    )
    batch_updates[1, n:] = math.nan  # garbage in padding changes nothing either
    mask = batch_senders >= 0
    identities = {"receivers": torch.tensor([0, 1]), "senders": batch_senders}
    return (
        batch_updates,
        batch_weights,
        mask,
        identities,
        [by_arrival(labels), by_arrival([labels[i] for i in order])],
    )


def by_arrival(labels: list[str]) -> list[str]:
    """The first copy to arrive is the one a defense may keep; the later ones are repeats."""
    first = labels.index("copy")
    return [
        ("first copy" if i == first else "repeat") if label == "copy" else label
        for i, label in enumerate(labels)
    ]


# -- the shared screen ---------------------------------------------------------------------
def test_finite_rows_and_first_per_sender():
    updates = torch.tensor([[[1.0, 2.0], [math.nan, 0.0], [math.inf, -math.inf], [0.0, -math.inf]]])
    assert finite_rows(updates)[0].tolist() == [True, False, False, False]
    assert (
        finite_rows(updates, torch.tensor([[False, True, True, True]]))[0].tolist() == [False] * 4
    )
    senders = torch.tensor([[4, 2, 4, 4, 2, -1], [7, 7, 7, 3, 3, -1]])
    mask = torch.tensor([[True] * 5 + [False], [False, True, True, True, True, False]])
    assert first_per_sender(senders, mask).tolist() == [
        [True, True, False, False, False, False],
        [False, True, False, True, False, False],
    ]


def test_screen_masks_zeroes_and_copies_only_when_needed():
    updates, weights, mask, identities, labels = hostile_batch()
    clean = screen(updates, weights, mask, identities["senders"])
    assert torch.isfinite(clean.updates).all() and torch.isfinite(clean.weights).all()
    for b, row in enumerate(labels):
        usable = [label in ("honest", "first copy") for label in row] + [False, False]
        assert clean.mask[b].tolist() == usable
        assert clean.weights[b].tolist() == [1.0 if u else 0.0 for u in usable]
    fine = torch.randn(1, 3, 2, dtype=torch.float64)
    assert screen(fine, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool)).updates is fine


def test_weighted_mean_ignores_non_finite_updates_and_bad_weights():
    updates = torch.tensor(
        [[[1.0, 1.0], [math.nan, 0.0], [math.inf, 1.0], [9.0, 9.0], [9.0, 9.0], [3.0, 3.0]]]
    )
    weights = torch.tensor([[1.0, 1.0, 1.0, math.nan, -2.0, 1.0]])
    assert weighted_mean(updates, weights)[0].tolist() == [2.0, 2.0]
    assert weighted_mean(updates[:, 1:3], weights[:, 1:3])[0].tolist() == [
        0.0,
        0.0,
    ]  # nothing usable: zeros
    # weights are normalised first: a huge finite float32 update times a sample count does not overflow
    huge = torch.tensor([[[1e38], [1.0]]], dtype=torch.float32)
    assert weighted_mean(huge, torch.tensor([[100.0, 100.0]])).isfinite().all()


def test_coordinate_helpers_leave_non_finite_updates_out_of_the_order_statistics():
    from p4bench_defenses.median import coordinate_median
    from p4bench_defenses.trimmed_mean import trimmed_mean

    updates = torch.tensor(
        [[[1.0], [2.0], [3.0], [math.inf], [math.inf], [-math.inf], [math.nan]]],
        dtype=torch.float64,
    )
    mask = torch.ones(1, 7, dtype=torch.bool)
    assert coordinate_median(updates, mask).tolist() == [[2.0]]
    assert trimmed_mean(updates, mask, torch.tensor([1])).tolist() == [[2.0]]


def test_krum_ranks_non_finite_distances_last():
    # a huge but finite update overflows every squared distance to it: +inf, never 0
    updates = torch.tensor([[[0.0], [1.0], [2.0], [1e200], [math.nan]]], dtype=torch.float64)
    scores = krum_scores(updates, torch.ones(1, 5, dtype=torch.bool), torch.tensor([1]))
    assert scores[0, :3].isfinite().all() and scores[0, 3:].tolist() == [math.inf, math.inf]
    kept = MultiKrum(RunConfig()).select(
        updates, torch.ones(1, 5), torch.ones(1, 5, dtype=torch.bool)
    )
    assert kept[0].tolist() == [True, True, True, False, False]


def test_duplicates_outvote_m_krum_only_without_sender_ids():
    updates, weights, mask, identities, _ = hostile_batch()
    defense = MultiKrum(RunConfig())
    blind, _ = defense.aggregate(
        updates, weights, mask
    )  # no ids: 10 identical copies score 0 and all stay
    assert (blind[0] - MU).abs().max() > 0.5
    combined, kept = defense.aggregate(updates, weights, mask, **identities)
    assert (combined - MU).abs().max() < TOLERANCE["m-krum"]


# -- every registered defense --------------------------------------------------------------
@pytest.mark.parametrize("cls", defense_classes(), ids=lambda cls: cls.name)
def test_every_defense_drops_non_finite_bad_weights_and_repeats(cls):
    assert cls.name in TOLERANCE, f"give defense {cls.name} a tolerance (its family) in TOLERANCE"
    updates, weights, mask, identities, labels = hostile_batch()
    combined, kept = build(cls).aggregate(updates, weights, mask, **identities)
    assert torch.isfinite(combined).all(), cls.name
    deviation = float((combined - MU).abs().max())
    assert deviation <= TOLERANCE[cls.name], f"{cls.name}: {deviation:.3g} from the honest mean"
    assert not (kept & ~mask).any()
    for b, row in enumerate(labels):
        for i, label in enumerate(row):
            if label not in ("honest", "first copy"):
                assert not kept[b, i], f"{cls.name} kept the {label} update"
            elif label == "honest" and not cls.filters:
                assert kept[b, i], (
                    f"{cls.name} drops nothing by design, but dropped an honest update"
                )
        assert kept[b].any()


@pytest.mark.parametrize("cls", defense_classes(), ids=lambda cls: cls.name)
def test_a_receiver_with_only_non_finite_updates_gets_zeros(cls):
    updates, weights, mask, identities, _ = hostile_batch()
    updates[1, :-2] = math.nan  # receiver 1: nothing usable; receiver 0 as before
    combined, kept = build(cls).aggregate(updates, weights, mask, **identities)
    assert combined[1].tolist() == [0.0] * SIZE and not kept[1].any()
    assert torch.isfinite(combined[0]).all() and kept[0].any()
    selected = build(cls).select(updates, weights, mask, **identities)
    assert not (selected & ~screen(updates, weights, mask, identities["senders"]).mask).any()


def test_the_aggregator_counts_one_update_per_sender_for_every_defense():
    # median declares no `uses_identities`: the screen still gets the sender ids
    median = Registry(create_plugin_manager(autoload=False)).get("defense", "median")
    aggregator = Aggregator(median(RunConfig()))
    src = torch.tensor([0, 1, 2, 3, 3, 3, 3])
    vectors = torch.tensor([[1.0], [2.0], [3.0], [-50.0], [-50.0], [-50.0], [-50.0]])
    inbox = Messages(src, torch.zeros(7, dtype=torch.int64), {"update.w": vectors})
    mean = aggregator.aggregate(inbox, torch.ones(7, dtype=torch.float64), round_index=0)
    assert mean.tolist() == [1.5]  # median of 1, 2, 3, -50 (with the copies: -50)
    assert aggregator.log == [(0, [0, 1, 2, 3], [3, 3, 3])]


# -- in runs -------------------------------------------------------------------------------
class NonFiniteUpdates(Attack):
    """Test-only: malicious clients send NaN, +inf and -inf in their updates."""

    name = "non-finite-updates"

    def tamper(self, exchange, messages, rng, reference=None):
        vectors = update_vectors(messages.payload).clone()
        vectors[:, 0::3], vectors[:, 1::3], vectors[:, 2::3] = math.nan, math.inf, -math.inf
        return Messages(messages.src, messages.dst, with_update_vectors(messages.payload, vectors))


class Plugin:
    @hookimpl
    def register_attacks(self):
        return [NonFiniteUpdates]


def _accuracy(config) -> float:
    pm = create_plugin_manager(extra_plugins=(Plugin(),), autoload=False)
    return float(run(config, plugin_manager=pm, track=False).summary["accuracy_mean"])


@pytest.mark.parametrize("defense", ["m-krum", "median", "none"])
def test_fedavg_with_a_nan_sender_stays_near_the_clean_accuracy(small_config, defense):
    base = dict(method="fedavg", clients=10, rounds=3, malicious_fraction=0.3, defense=defense)
    clean = _accuracy(small_config(**base, attack=None))
    attacked = _accuracy(small_config(**base, attack="non-finite-updates"))
    assert math.isfinite(attacked) and attacked >= clean - 0.1, (clean, attacked)


def test_p4_secure_with_a_nan_sender_stays_near_the_clean_accuracy(small_config):
    base = dict(
        method="p4", clients=12, rounds=2, malicious_fraction=0.25, options={"group_size": 4}
    )
    clean = _accuracy(small_config(**base, attack=None))
    attacked = _accuracy(small_config(**base, attack="non-finite-updates"))
    assert math.isfinite(attacked) and attacked >= clean - 0.1, (clean, attacked)
