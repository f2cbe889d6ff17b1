"""The engine: method interface, messages, threats and runtimes.

The names below are imported on first use (`p4bench.lazy`): the plugin host imports
this package to register the built-in runtimes, and the command line must start
without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.engine.messages import (
        BROADCAST,
        UPDATE_PREFIX,
        MessageFormatError,
        Messages,
        decode,
        encode,
    )
    from p4bench.engine.method import (
        DEFAULT_EPSILON,
        Capabilities,
        Exchange,
        LocalUpdate,
        Method,
        Phase,
        StepContext,
    )
    from p4bench.engine.runtime import GroupedRuntime, Job, Outcome, RoundReport, Runtime
    from p4bench.engine.state import State
    from p4bench.engine.threats import (
        Aggregator,
        Attack,
        Defense,
        update_vectors,
        with_update_vectors,
    )
    from p4bench.engine.training import local_sgd

__all__ = [
    "BROADCAST",
    "Aggregator",
    "Attack",
    "Capabilities",
    "DEFAULT_EPSILON",
    "Defense",
    "Exchange",
    "GroupedRuntime",
    "Job",
    "LocalUpdate",
    "MessageFormatError",
    "Messages",
    "Method",
    "Outcome",
    "Phase",
    "RoundReport",
    "Runtime",
    "State",
    "StepContext",
    "UPDATE_PREFIX",
    "decode",
    "encode",
    "local_sgd",
    "update_vectors",
    "with_update_vectors",
]

__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.engine.messages": (
            "BROADCAST",
            "UPDATE_PREFIX",
            "MessageFormatError",
            "Messages",
            "decode",
            "encode",
        ),
        "p4bench.engine.method": (
            "DEFAULT_EPSILON",
            "Capabilities",
            "Exchange",
            "LocalUpdate",
            "Method",
            "Phase",
            "StepContext",
        ),
        "p4bench.engine.runtime": ("GroupedRuntime", "Job", "Outcome", "RoundReport", "Runtime"),
        "p4bench.engine.state": ("State",),
        "p4bench.engine.threats": (
            "Aggregator",
            "Attack",
            "Defense",
            "update_vectors",
            "with_update_vectors",
        ),
        "p4bench.engine.training": ("local_sgd",),
    },
)
