"""Registers the built-in models: `p4bench.models` (linear, scatter-cnn, cnn) and Karras
et al.'s Table I CNN (`p4bench.models_karras`, cnn-gray). The classes are imported when
the hook is called: building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.models import Model


@hookimpl
def register_models() -> list[type[Model]]:
    from p4bench.models import LinearSoftmax, ScatterCNN, SmallCNN
    from p4bench.models_karras import GrayCNN

    return [LinearSoftmax, ScatterCNN, SmallCNN, GrayCNN]
