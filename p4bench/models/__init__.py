"""Models every method trains: the model contract and the built-in linear and CNN models
(`base`), batched layers evaluated for every client at once (`stacked`), functional dropout
(`dropout`) and their registration (`builtin`).

The names below are imported on first use (`p4bench.lazy`): the plugin host imports this
package to register the built-in models, and the command line must start without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.models.base import (
        LinearSoftmax,
        Model,
        Params,
        ScatterCNN,
        SmallCNN,
        conv_init,
        linear_init,
    )

__all__ = ["LinearSoftmax", "Model", "Params", "ScatterCNN", "SmallCNN", "conv_init", "linear_init"]

__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.models.base": (
            "LinearSoftmax",
            "Model",
            "Params",
            "ScatterCNN",
            "SmallCNN",
            "conv_init",
            "linear_init",
        )
    },
)
