"""Attack plugins, registered through the same hook as third-party attacks.

The P4 paper's threat model: label-flip (data poisoning) and byzantine-zero / -random /
-flip (model replacement); Karras et al.'s noisy clients: random-labels. From the robustness literature: gaussian, sign-flip, and the
omniscient alie, ipm and min-max. The P4L paper's attacks: label-flip-pair, label-flip-random-pair,
label-shuffle (data poisoning) and kde-noise (its noisy peers, a message attack). Against cross-gradient
methods (PDSL): model-probe, a malicious neighbour's crafted model (an active gradient-inversion probe).
"""

from p4bench.attacks.alie import ALittleIsEnough
from p4bench.attacks.byzantine import ByzantineFlip, ByzantineRandom, ByzantineZero
from p4bench.attacks.gaussian import Gaussian
from p4bench.attacks.ipm import InnerProductManipulation
from p4bench.attacks.kde_noise import KDENoise
from p4bench.attacks.label_flip import LabelFlip
from p4bench.attacks.label_pair import LabelFlipPair, LabelFlipRandomPair
from p4bench.attacks.label_shuffle import LabelShuffle
from p4bench.attacks.min_max import MinMax
from p4bench.attacks.model_probe import ModelProbe
from p4bench.attacks.random_labels import RandomLabels
from p4bench.attacks.sign_flip import SignFlip
from p4bench.hookspecs import hookimpl


@hookimpl
def register_attacks():
    return [
        LabelFlip, ByzantineZero, ByzantineRandom, ByzantineFlip,
        Gaussian, SignFlip, ALittleIsEnough, InnerProductManipulation, MinMax, RandomLabels,
        LabelFlipPair, LabelFlipRandomPair, LabelShuffle, KDENoise, ModelProbe,
    ]
