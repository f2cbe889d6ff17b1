"""P4's options (``-o key=value``) and the values they may take."""

from __future__ import annotations

from p4bench.engine.equivocation import EQUIVOCATION_OPTION
from p4bench.engine.precision import PRECISIONS
from p4bench.options import Option
from p4bench_p4.span import NOISE_MODES

__all__ = ["AGGREGATOR_CHECKS", "FUSED_MODES", "GROUP_SIZE_DEFAULTS", "OPTIONS", "TEACHERS"]

GROUP_SIZE_DEFAULTS = {"cifar10": 8, "femnist": 8, "leaf-femnist": 8, "cifar100": 4}
FUSED_MODES = ("auto", "span", "buckets", "off")
TEACHERS = ("none", "last-proxy", "private")
# How far members trust the round's aggregator (p4bench_p4.aggregator_check): recompute
# (default: the turn is checked and every member recomputes the aggregate from the uploads,
# which go to every member), turn (the turn only), none (the paper's single aggregator)
AGGREGATOR_CHECKS = ("recompute", "turn", "none")

OPTIONS = (
    Option(
        "group_size",
        int,
        None,
        "V, clients per group; default: 8 for cifar10/femnist/leaf-femnist, 4 for "
        "others (at most M)",
        low=1,
    ),
    Option(
        "samples",
        int,
        None,
        "H, peers each client probes in phase 1; default: min(35, M-1)",
        low=1,
        paper="35 probes, section VI",
    ),
    Option(
        "teacher",
        str,
        "none",
        "what the DP proxy distils from: none (CE alone), last-proxy (the group's last "
        "released proxy) or private (the paper's non-DP model: epsilon uncertified)",
        choices=TEACHERS,
    ),
    Option(
        "alpha",
        float,
        None,
        "the proxy's distillation weight; default: 0.5 with a teacher, 0 without (a "
        "positive alpha needs a teacher)",
        low=0,
        high=1,
    ),
    Option("beta", float, 0.5, "the private model's distillation weight", low=0, high=1),
    Option(
        "grouping",
        str,
        "similarity",
        "phase 1: similarity grouping, or random groups (ablation)",
        choices=("similarity", "random"),
    ),
    Option("proxy", bool, True, "false: one shared DP model instead of proxy + private (ablation)"),
    Option(
        "fused",
        str,
        "auto",
        "linear models: auto picks by FLOPs between the span and the bucketed fused "
        "step; off runs the generic autograd step (true = auto, false = off)",
        choices=FUSED_MODES + ("true", "false"),
    ),
    Option(
        "span_noise",
        str,
        "basis",
        "span path DP noise: basis (through an orthonormal basis of the client's "
        "data, same distribution) or streams (the generic path's numbers)",
        choices=NOISE_MODES,
    ),
    Option(
        "aggregator_check",
        str,
        "recompute",
        "how members trust their group's aggregator: recompute (uploads go to every member, "
        "each recomputes the aggregate and keeps its own where the distributed model "
        "differs, naming the aggregator), turn (only an announcer whose turn it is is "
        "followed), none (the paper's single aggregator, trusted wholesale)",
        choices=AGGREGATOR_CHECKS,
    ),
    Option(
        "aggregator_tolerance",
        float,
        1e-4,
        "recompute: the largest difference between the distributed model and a member's "
        "own aggregate, relative to the aggregate's largest entry, still taken as equal "
        "(floating-point order; the aggregator adds no noise)",
        low=0,
    ),
    Option(
        "private_precision",
        str,
        "fp32",
        "the private model's training on CUDA where it runs through autograd (CNNs, "
        "fused=false): fp32, or tf32 for its forward and backward and the proxy's logits "
        "it distils from (the DP step stays float32)",
        choices=PRECISIONS,
    ),
    EQUIVOCATION_OPTION,  # the uploads every member recomputes from (aggregator_check=recompute)
)
