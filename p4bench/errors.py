"""One exception hierarchy; the CLI turns it into a one-line message and an exit code."""

from __future__ import annotations

from collections.abc import Iterable


class P4BenchError(Exception):
    """Base class of every error p4bench reports to a user."""

    exit_code: int = 1


class UsageError(P4BenchError):
    """Bad input from the user (config, options, names); exits with code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """An invalid configuration value, naming the field and the valid range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid value for '{field}': {message}")
        self.field = field


class UnknownNameError(UsageError):
    """A plugin name that is not registered; lists the registered names of that kind."""

    def __init__(self, kind: str, name: str, available: Iterable[str]) -> None:
        names = sorted(available)
        listed = ", ".join(names) if names else "(none registered)"
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        super().__init__(f"unknown {kind} '{name}'; registered {plural}: {listed}")
        self.kind, self.name, self.available = kind, name, names


class DuplicateNameError(UsageError):
    """Two plugins registered the same name for the same kind; exits with code 2."""


class PluginError(UsageError):
    """A plugin name whose registration is broken (not a class of its kind, ...)."""


class IncompatibleError(UsageError):
    """A combination of plugins that cannot run together (checked before training)."""


class DataError(UsageError):
    """Data that is missing, malformed or too small for the request."""
