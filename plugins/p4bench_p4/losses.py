"""P4's co-training losses (eqs. 8-11): cross-entropy plus KL distillation.

The loss itself is shared with ProxyFL's deep mutual learning and lives in the engine.
"""

from p4bench.engine.training import distillation_loss

__all__ = ["distillation_loss"]
