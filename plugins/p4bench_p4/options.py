"""P4's options (``-o key=value``) and the values they may take."""

from __future__ import annotations

from p4bench.options import Option
from p4bench_p4.span import NOISE_MODES

__all__ = ["FUSED_MODES", "GROUP_SIZE_DEFAULTS", "OPTIONS", "TEACHERS"]

GROUP_SIZE_DEFAULTS = {"cifar10": 8, "femnist": 8, "leaf-femnist": 8, "cifar100": 4}
FUSED_MODES = ("auto", "span", "buckets", "off")
TEACHERS = ("none", "last-proxy", "private")

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
)
