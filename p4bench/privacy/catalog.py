"""The accountants p4bench ships and registers itself (`p4bench.privacy.builtin`)."""

from __future__ import annotations

from p4bench.privacy.accountants import Accountant, NobleAccountant, PRVAccountant, RDPAccountant
from p4bench.privacy.network_accountant import NetworkAccountant
from p4bench.privacy.pld import PLDAccountant

__all__ = ["BUILTIN_ACCOUNTANTS"]

BUILTIN_ACCOUNTANTS: tuple[type[Accountant], ...] = (
    RDPAccountant,
    PRVAccountant,
    PLDAccountant,
    NobleAccountant,
    NetworkAccountant,
)
"""The accountants p4bench registers itself (`p4bench.privacy.builtin`)."""
