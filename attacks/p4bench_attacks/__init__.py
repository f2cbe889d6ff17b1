"""Attack plugins, registered through the same hook as third-party attacks.

The P4 paper's threat model: label-flip (data poisoning) and byzantine-zero / -random /
-flip (model replacement); Karras et al.'s noisy clients: random-labels. From the robustness
literature: gaussian, sign-flip, and the
omniscient alie, ipm and min-max. The P4L paper's attacks: label-flip-pair, label-flip-random-pair,
label-shuffle (data poisoning) and kde-noise (its noisy peers, a message attack). Against cross-gradient
methods (PDSL): model-probe, a malicious neighbour's crafted model (an active gradient-inversion probe).
What an authenticated peer can send besides a bad update: nan-update (non-finite payloads),
duplicate-messages (copies that outvote), weight-lie (a false aggregation weight) and
late-sender (every batch held back until just before the exchange timeout; device runtime).
Against gossip (decentralized) methods: dissensus (He, Karimireddy and Jaggi 2022) and
spectral (a push along the honest graph's Fiedler vector), crafted per receiver; equivocate
(a poisoned model to some receivers, the honest one to the others, where all should get the same).
Against a group's rotating aggregator (P4): aggregator-poison (it distributes a poisoned model).
Free riding and inflated influence: stale-replay (an earlier model re-sent, one's own or another's)
and record-inflation (more records declared than held, with a negated update).

The classes are imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.threats import Attack
    from p4bench_attacks.aggregator_poison import AggregatorPoison
    from p4bench_attacks.alie import ALittleIsEnough
    from p4bench_attacks.byzantine import ByzantineFlip, ByzantineRandom, ByzantineZero
    from p4bench_attacks.dissensus import Dissensus
    from p4bench_attacks.duplicate_messages import DuplicateMessages
    from p4bench_attacks.equivocate import Equivocate
    from p4bench_attacks.gaussian import Gaussian
    from p4bench_attacks.ipm import InnerProductManipulation
    from p4bench_attacks.kde_noise import KDENoise
    from p4bench_attacks.label_flip import LabelFlip
    from p4bench_attacks.label_pair import LabelFlipPair, LabelFlipRandomPair
    from p4bench_attacks.label_shuffle import LabelShuffle
    from p4bench_attacks.late_sender import LateSender
    from p4bench_attacks.min_max import MinMax
    from p4bench_attacks.model_probe import ModelProbe
    from p4bench_attacks.nan_update import NanUpdate
    from p4bench_attacks.random_labels import RandomLabels
    from p4bench_attacks.record_inflation import RecordInflation
    from p4bench_attacks.sign_flip import SignFlip
    from p4bench_attacks.spectral import Spectral
    from p4bench_attacks.stale_replay import StaleReplay
    from p4bench_attacks.weight_lie import WeightLie

PACKAGE = LazyPackage(
    globals(),
    {
        "p4bench_attacks.aggregator_poison": ("AggregatorPoison",),
        "p4bench_attacks.alie": ("ALittleIsEnough",),
        "p4bench_attacks.byzantine": ("ByzantineFlip", "ByzantineRandom", "ByzantineZero"),
        "p4bench_attacks.dissensus": ("Dissensus",),
        "p4bench_attacks.duplicate_messages": ("DuplicateMessages",),
        "p4bench_attacks.equivocate": ("Equivocate",),
        "p4bench_attacks.gaussian": ("Gaussian",),
        "p4bench_attacks.ipm": ("InnerProductManipulation",),
        "p4bench_attacks.kde_noise": ("KDENoise",),
        "p4bench_attacks.label_flip": ("LabelFlip",),
        "p4bench_attacks.label_pair": ("LabelFlipPair", "LabelFlipRandomPair"),
        "p4bench_attacks.label_shuffle": ("LabelShuffle",),
        "p4bench_attacks.late_sender": ("LateSender",),
        "p4bench_attacks.min_max": ("MinMax",),
        "p4bench_attacks.model_probe": ("ModelProbe",),
        "p4bench_attacks.nan_update": ("NanUpdate",),
        "p4bench_attacks.random_labels": ("RandomLabels",),
        "p4bench_attacks.record_inflation": ("RecordInflation",),
        "p4bench_attacks.sign_flip": ("SignFlip",),
        "p4bench_attacks.spectral": ("Spectral",),
        "p4bench_attacks.stale_replay": ("StaleReplay",),
        "p4bench_attacks.weight_lie": ("WeightLie",),
    },
)  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_attacks() -> list[type[Attack]]:
    return PACKAGE.load()
