"""The engine: method interface, messages, threats and runtimes."""

from p4bench.engine.messages import MessageFormatError, Messages, decode, encode
from p4bench.engine.method import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Method, Phase, StepContext
from p4bench.engine.runtime import GroupedRuntime, Job, Outcome, RoundReport, Runtime
from p4bench.engine.state import State
from p4bench.engine.threats import UPDATE_PREFIX, Aggregator, Attack, Defense, update_vectors, with_update_vectors
from p4bench.engine.training import local_sgd

__all__ = [
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
