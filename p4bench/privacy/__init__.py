"""Differential-privacy accounting: pure analyses, accountant plugins, calibration.

- :mod:`p4bench.privacy.analysis`: stateless epsilon functions (RDP, PRV), and
  :mod:`p4bench.privacy.noble` (Noble et al.'s bound);
- :mod:`p4bench.privacy.accountants`: the ``accountant`` plugins over a client's
  history of :class:`ReleaseSegment`, and :func:`accounted_epsilon` for a run's
  neighbouring relation;
- :mod:`p4bench.privacy.pld`: the ``pld`` accountant (dp-accounting's privacy-loss
  distributions, add-remove and replace-one natively);
- :mod:`p4bench.privacy.calibration`: the noise multiplier for a target epsilon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p4bench.lazy import lazy_exports

if TYPE_CHECKING:  # imported on first use (`p4bench.lazy`): the command line starts without scipy
    from p4bench.privacy.accountants import (
        Accountant,
        NobleAccountant,
        PRVAccountant,
        RDPAccountant,
        ReleaseSegment,
        accounted_epsilon,
        compact_history,
    )
    from p4bench.privacy.analysis import (
        DEFAULT_ORDERS,
        VIEWS,
        PrivacyAccountingError,
        prv_epsilon,
        prv_epsilon_history,
        rdp_epsilon,
        rdp_epsilon_history,
        rdp_privacy_spent,
    )
    from p4bench.privacy.calibration import calibrate_accountant, calibrate_noise
    from p4bench.privacy.catalog import BUILTIN_ACCOUNTANTS
    from p4bench.privacy.noble import noble_epsilon, noble_epsilon_floor, noble_privacy_spent
    from p4bench.privacy.pld import PLDAccountant, pld_epsilon

__all__ = [
    "DEFAULT_ORDERS",
    "VIEWS",
    "PrivacyAccountingError",
    "rdp_epsilon",
    "rdp_epsilon_history",
    "rdp_privacy_spent",
    "prv_epsilon",
    "prv_epsilon_history",
    "noble_epsilon",
    "noble_privacy_spent",
    "noble_epsilon_floor",
    "pld_epsilon",
    "ReleaseSegment",
    "Accountant",
    "RDPAccountant",
    "PRVAccountant",
    "PLDAccountant",
    "NobleAccountant",
    "BUILTIN_ACCOUNTANTS",
    "accounted_epsilon",
    "compact_history",
    "get_accountant",
    "calibrate_noise",
    "calibrate_accountant",
]


__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.privacy.accountants": (
            "Accountant",
            "NobleAccountant",
            "PRVAccountant",
            "RDPAccountant",
            "ReleaseSegment",
            "accounted_epsilon",
            "compact_history",
        ),
        "p4bench.privacy.analysis": (
            "DEFAULT_ORDERS",
            "VIEWS",
            "PrivacyAccountingError",
            "prv_epsilon",
            "prv_epsilon_history",
            "rdp_epsilon",
            "rdp_epsilon_history",
            "rdp_privacy_spent",
        ),
        "p4bench.privacy.calibration": ("calibrate_accountant", "calibrate_noise"),
        "p4bench.privacy.noble": ("noble_epsilon", "noble_epsilon_floor", "noble_privacy_spent"),
        "p4bench.privacy.catalog": ("BUILTIN_ACCOUNTANTS",),
        "p4bench.privacy.pld": ("PLDAccountant", "pld_epsilon"),
    },
)


def get_accountant(name: str, *, registry: Any) -> Accountant:
    """An instance of the accountant `name` registered in `registry` (a
    `p4bench.host.manager.Registry`, e.g. `default_registry()`; passed in, as this
    package sits below the plugin host).

    Raises :class:`p4bench.errors.UnknownNameError` (listing the registered names) for
    an unknown name.
    """
    accountant: Accountant = registry.get("accountant", name)()
    return accountant
