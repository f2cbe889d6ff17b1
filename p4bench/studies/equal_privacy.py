"""Equal privacy in one table: the rule every study (`sweep`, `tune`, `compare`, `impact`,
`reproduce`) applies before it puts runs side by side.

Accuracy at "epsilon 15" means different things under different neighbouring relations:
replace-one (P4's default, noise std 2 sigma C, converted to rdp/prv by group privacy) gives
about twice the noise of add-remove at the same figure. And an *uncertified* epsilon (a data-
dependent step outside the ledger, see `p4bench.privacy.certification`) is no privacy claim
at all. So, for the runs of one table:

- every private run must use the same neighbouring relation, delta and accountant (where the
  runs record them: runs that have not run yet are checked when they have), and
- no private run may be uncertified, unless it is a declared reference row (the tag
  `reference`, from a sweep variant's `reference` key, e.g. a paper's uncertified variant
  shown beside the certified one): it keeps its `... UNCERTIFIED` mark, its own row, and no
  claim uses it (`p4bench.studies.claims.without_references`).

Non-private runs (`dp.private=false`: local training, a `--no-dp` reference) may appear; they
are marked `non-private`. A table that breaks the rule is refused with a `UsageError` (exit 2)
naming the offending runs, unless the user asks for it explicitly (`--allow-mixed-privacy`,
`allow_mixed=True`); then each run's relation and certification is shown in a `privacy`
column (`add-remove`, `replace-one`, `... UNCERTIFIED`, `non-private`) and a warning is printed.
Whenever the runs of a table do not all carry the same mark (e.g. private methods next to
non-private local training), that column is there too, so a reader sees which is which.

Studies that *plan* runs (sweeps, tuning, presets) settle one relation up front: a private
run that names no `neighbouring` gets the relation the study's runs name explicitly, or
add-remove when none does (`STUDY_DEFAULT`; the paper's P4 default replace-one would give P4
twice the noise of every baseline). Runs that name different relations are refused before
anything trains, unless mixing is allowed.

What a run is: from MLflow, the tags `dp.private`, `dp.certified`, `dp.neighbouring`,
`dp.uncertified_reason` (runs logged before these tags existed fall back to their parameters
and count as uncertified: nothing certified them); from a run summary, `private`,
`epsilon_certified`, `neighbouring`, `uncertified_reason`; from a planned config, the method's
defaults (`Method.default_epsilon`, `Method.default_neighbouring`), certification unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p4bench.errors import UsageError

__all__ = [
    "UnequalPrivacyError",
    "RunPrivacy",
    "PrivacyCheck",
    "check_privacy",
    "from_row",
    "from_summary",
    "from_config",
    "settle_relation",
    "COLUMN",
    "FLAG",
    "STUDY_DEFAULT",
    "NON_PRIVATE",
]

COLUMN = "privacy"  # the column that marks each run's relation and certification
FLAG = "--allow-mixed-privacy"
STUDY_DEFAULT = "add-remove"
NON_PRIVATE = "non-private"
UNCERTIFIED = "UNCERTIFIED"
_LISTED = 4  # runs named per group in a refusal; the rest are counted


class UnequalPrivacyError(UsageError):
    """Runs under different neighbouring relations, or uncertified, in one table (exit 2)."""


@dataclass(frozen=True)
class RunPrivacy:
    """One run's privacy as far as a table is concerned."""

    run: str  # a label naming the run (method, variant, seed, id)
    method: str
    private: bool
    neighbouring: str | None = None
    certified: bool = True  # meaningful for private runs only
    reason: str | None = None  # why not certified
    delta: float | None = None  # None: not known (yet)
    accountant: str | None = None
    reference: str | None = None  # a declared reference row: why (may then be uncertified)

    @property
    def relation(self) -> str:
        return self.neighbouring or "unknown relation"

    @property
    def mark(self) -> str:
        """`non-private`, the relation (`add-remove`, `replace-one`), or `<relation> UNCERTIFIED`."""
        if not self.private:
            return NON_PRIVATE
        return self.relation if self.certified else f"{self.relation} {UNCERTIFIED}"


@dataclass
class PrivacyCheck:
    """The verdict on the runs of one table."""

    runs: list[RunPrivacy]
    problems: list[str] = field(
        default_factory=list
    )  # why the table breaks the rule (empty: it does not)
    allowed: bool = False  # the user asked for a mixed table

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def marks(self) -> list[str]:
        return list(dict.fromkeys(r.mark for r in self.runs))

    @property
    def needs_column(self) -> bool:
        """Whether the table must mark each row: its runs do not all carry the same mark."""
        return len(self.marks) > 1

    @property
    def relation(self) -> str | None:
        """The one relation of the private runs (None when there are none, or several)."""
        relations = {r.relation for r in self.runs if r.private}
        return next(iter(relations)) if len(relations) == 1 else None

    @property
    def warning(self) -> str | None:
        if self.ok:
            return None
        return (
            f"runs under unequal privacy are compared because {FLAG} was given; the '{COLUMN}' column marks "
            f"each one: {'; '.join(self.problems)}"
        )

    def note(self, certification: bool = True) -> str:
        """One line: which methods are private under which relation (and, with
        `certification`, whether their epsilon is certified), which are not."""
        by_mark: dict[str, list[str]] = {}
        for run in self.runs:
            methods = by_mark.setdefault(run.mark, [])
            name = f"{run.method} (reference)" if run.reference else run.method
            if name not in methods:
                methods.append(name)
        parts = []
        for mark, methods in by_mark.items():
            if mark == NON_PRIVATE:
                parts.append(f"non-private: {', '.join(methods)}")
            elif mark.endswith(UNCERTIFIED):
                parts.append(
                    f"private, {mark.replace(' ' + UNCERTIFIED, '')} neighbouring, epsilon UNCERTIFIED: "
                    f"{', '.join(methods)}"
                )
            else:
                certified = ", certified epsilon" if certification else ""
                parts.append(f"private, {mark} neighbouring{certified}: {', '.join(methods)}")
        return "privacy: " + ("; ".join(parts) if parts else "no runs")


def _named(runs: Sequence[RunPrivacy], detail: bool = False) -> str:
    # braces, not brackets: the CLI prints with rich, which reads [words] as markup
    shown = [
        f"{r.run}" + (f" {{why: {r.reason}}}" if detail and r.reason else "")
        for r in runs[:_LISTED]
    ]
    more = len(runs) - _LISTED
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def check_privacy(
    runs: Iterable[RunPrivacy],
    *,
    allow_mixed: bool = False,
    what: str = "this table",
    certification: bool = True,
) -> PrivacyCheck:
    """Apply the rule to the runs of one table. Raises UsageError (exit 2) naming the
    offending runs unless `allow_mixed`; `certification=False` checks relations only (runs
    that have not run yet)."""
    runs = list(runs)
    verdict = PrivacyCheck(runs, allowed=allow_mixed)
    private = [r for r in runs if r.private]
    by_relation: dict[str, list[RunPrivacy]] = {}
    for run in private:
        by_relation.setdefault(run.relation, []).append(run)
    if len(by_relation) > 1:
        groups = "; ".join(
            f"{relation}: {_named(members)}" for relation, members in sorted(by_relation.items())
        )
        verdict.problems.append(f"private runs under different neighbouring relations ({groups})")
    for name, value_of in (
        ("delta", lambda r: None if r.delta is None else f"{r.delta:.6g}"),
        ("accountant", lambda r: r.accountant),
    ):
        by_value: dict[str, list[RunPrivacy]] = {}
        for run in private:
            value = value_of(run)
            if value is not None:
                by_value.setdefault(value, []).append(run)
        if len(by_value) > 1:
            groups = "; ".join(
                f"{value}: {_named(members)}" for value, members in sorted(by_value.items())
            )
            verdict.problems.append(f"private runs under different {name} ({groups})")
    # a declared reference row may be uncertified: it is marked, and never in a claim
    uncertified = (
        [r for r in private if not r.certified and not r.reference] if certification else []
    )
    if uncertified:
        verdict.problems.append(f"uncertified epsilon: {_named(uncertified, detail=True)}")
    if verdict.problems and not allow_mixed:
        raise UnequalPrivacyError(
            f"{what}: refusing to compare runs under unequal privacy: {'; '.join(verdict.problems)}. "
            f"Give one neighbouring relation, delta and accountant to every private run (and certified "
            f"settings), or pass "
            f"{FLAG} to compare them anyway, marked in a '{COLUMN}' column"
        )
    return verdict


# -- what a run is ----------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    """A tag or parameter as text; None for missing values (NaN in a DataFrame) and 'none'."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value).strip()
    return None if not text or text.lower() in ("none", "null", "nan") else text


def _label(method: str, seed: Any, run_id: Any = None, variant: Any = None) -> str:
    parts = [method]
    if _text(variant):
        parts.append(f"'{variant}'")
    if _text(seed) is not None:
        parts.append(f"seed={seed}")
    if _text(run_id):
        parts.append(f"({str(run_id)[:8]})")
    return " ".join(parts)


def from_row(row: Mapping[str, Any], params: str = "params.") -> RunPrivacy:
    """A finished MLflow run read back as a row: tags as plain keys, parameters under `params`."""
    method = _text(row.get("method")) or _text(row.get(f"{params}method")) or "?"
    label = _label(method, row.get("seed"), row.get("run_id"), row.get("variant"))
    reference = _text(row.get("reference"))  # the tag of a declared reference row
    private_tag = _text(row.get("dp.private"))
    if private_tag is not None:
        private = private_tag.lower() == "true"
    else:  # logged before the dp.private tag: what its parameters say
        no_dp = (_text(row.get(f"{params}no_dp")) or "false").lower() == "true"
        private = not no_dp and any(
            _text(row.get(f"{params}{k}")) for k in ("epsilon", "noise_multiplier")
        )
    if not private:
        return RunPrivacy(label, method, False, reference=reference)
    neighbouring = (
        _text(row.get("dp.neighbouring"))
        or _text(row.get(f"{params}neighbouring"))
        or _default_relation(method)
    )
    certified_tag = _text(row.get("dp.certified"))
    delta = _number(_text(row.get("dp.delta")) or _text(row.get(f"{params}delta")))
    accountant = _text(row.get("dp.accountant")) or _text(row.get(f"{params}accountant"))
    if certified_tag is None:
        return RunPrivacy(
            label,
            method,
            True,
            neighbouring,
            False,
            "no dp.certified tag (logged before certification)",
            delta,
            accountant,
            reference,
        )
    certified = certified_tag.lower() == "true"
    reason = None if certified else (_text(row.get("dp.uncertified_reason")) or "not certified")
    return RunPrivacy(
        label, method, True, neighbouring, certified, reason, delta, accountant, reference
    )


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def from_summary(
    summary: Mapping[str, Any], label: str | None = None, reference: str | None = None
) -> RunPrivacy:
    """A run summary (`runner.run(...).summary`, a sweep record's summary); `reference`:
    the run's `reference` tag, if it is a declared reference row."""
    method = str(summary.get("method") or "?")
    label = label or _label(method, summary.get("seed"), summary.get("run_id"))
    reference = _text(reference)
    private = summary.get("private")
    if private is None:
        private = summary.get("epsilon") is not None
    if not private:
        return RunPrivacy(label, method, False, reference=reference)
    certified = summary.get("epsilon_certified")
    delta, accountant = _number(_text(summary.get("delta"))), _text(summary.get("accountant"))
    if certified is None:
        return RunPrivacy(
            label,
            method,
            True,
            _text(summary.get("neighbouring")),
            False,
            "no certification recorded",
            delta,
            accountant,
            reference,
        )
    reason = None if certified else (summary.get("uncertified_reason") or "not certified")
    return RunPrivacy(
        label,
        method,
        True,
        _text(summary.get("neighbouring")),
        bool(certified),
        reason,
        delta,
        accountant,
        reference,
    )


def _method_class(method: str, registry: Any = None) -> Any:
    from p4bench.host.manager import default_registry

    try:
        return (registry or default_registry()).get("method", method)
    except Exception:  # noqa: BLE001 - an unknown name fails later, with the registered names
        return None


def _default_relation(method: str, registry: Any = None) -> str | None:
    cls = _method_class(method, registry)
    return getattr(cls, "default_neighbouring", None) if cls is not None else None


def planned_private(config: Any, registry: Any = None) -> bool:
    """Whether a config will run private: an epsilon or noise multiplier, or a DP method's
    default epsilon, unless `no_dp`."""
    if getattr(config, "no_dp", False):
        return False
    if config.epsilon is not None or config.noise_multiplier is not None:
        return True
    cls = _method_class(config.method, registry)
    return bool(getattr(cls, "default_epsilon", None)) if cls is not None else False


def from_config(config: Any, label: str | None = None, registry: Any = None) -> RunPrivacy:
    """A run that has not run yet: its relation as the runner will resolve it; certified
    is assumed (only the run itself can tell)."""
    label = label or _label(config.method, config.seed)
    if not planned_private(config, registry):
        return RunPrivacy(label, config.method, False)
    return RunPrivacy(
        label,
        config.method,
        True,
        config.neighbouring or _default_relation(config.method, registry),
        delta=config.delta,
        accountant=config.accountant,
    )


def settle_relation(
    configs: Sequence[Any], registry: Any = None
) -> tuple[list[Any], str | None, bool]:
    """One relation for a study's private runs: (configs, relation, defaulted).

    Private runs that name no `neighbouring` get the one relation the others name, or
    `STUDY_DEFAULT` (add-remove) when none names one (`defaulted`). When the runs name
    different relations nothing is filled in (relation None): the study is mixed and the
    check refuses it unless mixing is allowed. Non-private runs are left as they are.
    """
    private = [planned_private(c, registry) for c in configs]
    named = {c.neighbouring for c, p in zip(configs, private) if p and c.neighbouring}
    if len(named) > 1:
        return list(configs), None, False
    relation = next(iter(named)) if named else STUDY_DEFAULT
    filled = [
        c.replace(neighbouring=relation) if p and c.neighbouring is None else c
        for c, p in zip(configs, private)
    ]
    return filled, relation, not named and any(private)
