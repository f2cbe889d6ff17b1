"""Registers the built-in models of `p4bench.models` (linear, scatter-cnn, cnn); Karras et
al.'s Table I CNN (cnn-gray) is registered beside their method (`p4bench_baselines`). The
classes are imported when the hook is called: building the plugin manager must not import
torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.models import Model


@hookimpl
def register_models() -> list[type[Model]]:
    from p4bench.models import LinearSoftmax, ScatterCNN, SmallCNN

    return [LinearSoftmax, ScatterCNN, SmallCNN]
