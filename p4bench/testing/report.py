"""What a conformance check found: one `CheckResult` per check, gathered in a
`ConformanceReport`; `ConformanceError` (an AssertionError) lists the failures."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckResult", "ConformanceError", "ConformanceReport"]


@dataclass(frozen=True)
class CheckResult:
    """One check: `passed` None means skipped (`message` says why)."""

    name: str  # e.g. "runtimes", "ledger", "capabilities.uses_server"
    passed: bool | None
    message: str = ""

    @property
    def skipped(self) -> bool:
        return self.passed is None

    def line(self) -> str:
        mark = "SKIP" if self.passed is None else "ok" if self.passed else "FAIL"
        return f"  [{mark}] {self.name}" + (f": {self.message}" if self.message else "")


@dataclass
class ConformanceReport:
    """Every check run on one plugin, in order."""

    kind: str  # "method" | "attack" | "defense"
    name: str
    results: list[CheckResult] = field(default_factory=list)
    skipped: frozenset[str] = (
        frozenset()
    )  # check names (or prefixes, "ledger.noise") the caller skips

    def add(self, name: str, passed: bool | None, message: str = "") -> bool:
        """Record one result (a skip when the caller skips `name` or a parent of it);
        returns `passed` (skips count as passed)."""
        parts = name.split(".")
        if any(".".join(parts[:i]) in self.skipped for i in range(1, len(parts) + 1)):
            passed, message = None, "skipped by the caller"
        self.results.append(CheckResult(name, passed, message))
        return passed is not False

    def ok(self, name: str, message: str = "") -> None:
        self.add(name, True, message)

    def fail(self, name: str, message: str) -> None:
        self.add(name, False, message)

    def skip(self, name: str, reason: str) -> None:
        self.add(name, None, reason)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.passed is False]

    def failed(self, prefix: str) -> bool:
        """Whether a check named `prefix` (or `prefix.*`) failed."""
        return any(r.name == prefix or r.name.startswith(prefix + ".") for r in self.failures)

    def names(self) -> list[str]:
        return [r.name for r in self.results]

    def __str__(self) -> str:
        verdict = "conforms" if self.passed else f"{len(self.failures)} check(s) failed"
        return "\n".join(
            [f"{self.kind} '{self.name}': {verdict}", *(r.line() for r in self.results)]
        )

    def raise_on_failure(self) -> ConformanceReport:
        """Raise `ConformanceError` listing every failed check; else return self."""
        if self.failures:
            raise ConformanceError(self)
        return self


class ConformanceError(AssertionError):
    """A plugin failed conformance checks; `report` holds every result."""

    def __init__(self, report: ConformanceReport) -> None:
        lines = [r.line() for r in report.failures]
        super().__init__(
            f"{report.kind} '{report.name}' failed {len(lines)} conformance check(s):\n"
            + "\n".join(lines)
        )
        self.report = report
